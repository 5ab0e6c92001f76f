"""The command-line flags of run.py; each overrides the same-named `jaxpar.Config` field."""

# (flag, type, help); every flag overrides the same-named Config field (dashes -> underscores).
FLAGS = [
    ("--mesh", str, "device mesh: '8' (data only), '2x4' (data x model) or 'data=2,model=4'; -1 = all remaining "
                    "devices. On a CPU-only machine the needed CPU devices are created (default 2x4)"),
    ("--model", str, "built-in model: transformer (byte-level LM), mlp or cnn (digits classifiers; default transformer)"),
    ("--steps", int, "number of optimizer updates (default 300)"),
    ("--batch-size", int, "GLOBAL batch size, split evenly over the data axis (default 32)"),
    ("--lr", float, "peak learning rate (default 3e-3)"),
    ("--optimizer", str, "adamw | sgd | momentum (SGD with momentum 0.9) (default adamw)"),
    ("--seed", int, "seed of initialisation, data order and dropout; same seed -> same run on any mesh (default 0)"),
    ("--data", str, "text file or folder for the transformer (default: the Python standard library's .py files)"),
    ("--metrics", str, "write one JSON object per logged step (step, loss, samples_per_sec, ...) to this .jsonl file"),
    ("--log-every", int, "print and log every K steps (default 10)"),
    ("--dropout", float, "dropout rate of the model (default 0.1)"),
    ("--strategy", str, "how replicas agree: sync | local_sgd | diloco | ssp | asp (default sync)"),
    ("--allreduce", str, "gradient/parameter averaging: psum | ring | torus2d | ps (default: XLA's partitioner for "
                         "sync, psum otherwise)"),
    ("--torus", int, "torus2d: X of the X x Y grid over the data axis (default: divisor nearest sqrt)"),
    ("--sync-period", int, "local_sgd/diloco: local steps between meetings H (default 4)"),
    ("--local-after", int, "local_sgd/diloco: post-local SGD, synchronous for the first K steps (default 0)"),
    ("--outer-lr", float, "diloco: outer Nesterov SGD learning rate (default 0.7)"),
    ("--outer-momentum", float, "diloco: outer momentum (default 0.9)"),
    ("--staleness", int, "ssp: largest staleness S of an applied gradient (default 2; 0 = BSP)"),
    ("--eval-every", int, "evaluate on the held-out split every N steps (default 0: only at the end)"),
    ("--lr-scaling", str, "none | linear | sqrt: lr x (global batch / --base-batch-size) or its square root"),
    ("--base-batch-size", int, "the batch size --lr was tuned for (default: the first global batch size)"),
    ("--warmup-steps", int, "gradual linear warmup over the first W steps (default 0)"),
    ("--lr-schedule", str, "constant | cosine | step, after warmup (default constant)"),
    ("--lr-decay-steps", str, "step schedule: comma-separated decay steps (default: 50%% and 75%% of --steps)"),
    ("--lr-decay-factor", float, "step schedule: lr multiplier at each decay step (default 0.1)"),
    ("--batch-ramp", str, "progressive global batch 'SIZE:FROM_STEP,...', e.g. '32:0,64:100' (replaces --batch-size;"
                          " one compilation per size; lr follows --lr-scaling)"),
    ("--label-smoothing", float, "label smoothing eps in [0, 1) for classification and LM losses (default 0)"),
    ("--grad-accum", int, "K microbatches per update (same update as the full batch; default 1)"),
    ("--bn", str, "cnn BatchNorm statistics: sync (global batch, default) | local (each data shard's own)"),
    ("--dtype", str, "compute dtype float32 | bfloat16 (parameters and optimizer state stay float32)"),
    ("--stragglers", str, "simulated worker speeds: '3:2.0' = replica 3 is 2x slower; add ',jitter=0.1' for seeded "
                          "log-normal jitter (sets sim_time in the metrics)"),
]
