"""`jaxpar.cli.Config`: the run configuration, one declaration per option under its section: name, type, default,
help, value checks (`jaxpar.cli.options` says what a declaration holds).

Which models and strategies an option applies to, and its default there, come from `models.REGISTRY` and
`jaxpar.cli.strategies`; model- and strategy-specific options default to None ("not given"). Resolution
(`defaults`), validation (`validation`), resume compatibility (`compat`) and the record a run writes (`records`) are
functions of a Config; its methods hand over to them.

Presets live in `configs/NAME.py` as `get_config() -> jaxpar.cli.Config`; CLI flags override their options.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import models
from jaxpar.cli import compat, defaults, paths, records, validation
from jaxpar.cli.options import GROUPS, Option, declared, section
from jaxpar.cli.runtimes import RUNTIMES
from jaxpar.cli.strategies import NAMES as STRATEGIES
from jaxpar.cli.values import (DTYPES, OPTIMIZERS, at_least, channels_check, coordinator_check, not_empty, one_of,
                               parse_decay_steps, parse_profile, parses, rules_check, within)
from jaxpar.cost.hardware import PROFILES, parse_hardware
from jaxpar.io.batches import DEFAULT_READ_AHEAD
from jaxpar.strategies.stragglers import parse_stragglers
from jaxpar.parallel.collectives import ALLREDUCE_ALGORITHMS, check_allreduce
from jaxpar.parallel.compression import parse_codec
from jaxpar.parallel.context import ALGORITHMS, DEFAULT as DEFAULT_CP
from jaxpar.parallel.mesh import parse_mesh_spec
from jaxpar.pipeline.config import SCHEDULES
from jaxpar.strategies import BN_LOCAL, BN_SYNC
from jaxpar.train.remat import REMATS
from jaxpar.train.lr_schedules import LR_SCALINGS, LR_SCHEDULES, parse_batch_ramp

_mesh, _pipe, _arch, _data, _optim, _strategy, _large, _run, _faults, _procs = map(section, GROUPS)
_models = " | ".join(f"{name} ({spec.summary})" for name, spec in models.REGISTRY.items())
_positive = at_least(1)
_count = at_least(0)


@dataclass
class Config:
    # --- mesh ---
    mesh: str = _mesh("2x4", "device mesh, axes data x stage x fsdp x seq x model; -1 in one place = all remaining "
                             "devices; '8' (data), '2x4' (data x model), '2x2x2' (data x fsdp x model), or named, e.g. "
                             "'data=2,fsdp=2,model=2' or 'fsdp=8' (absent axes have size 1); pipeline stages and the "
                             "sequence split only by name, e.g. 'stage=4', 'data=2,stage=2,model=2' (the model needs "
                             "stacked layers) or 'data=2,seq=4' (see --context-parallel). On a CPU-only machine the "
                             "needed CPU devices are created", check=parses(parse_mesh_spec))
    context_parallel: str | None = _mesh(None, f"how attention runs over the seq axis (context parallelism): "
                                         f"{' | '.join(ALGORITHMS)}; default {DEFAULT_CP}: one all-gather of K and V "
                                         "per layer, no head constraint; ring: K/V blocks passed around the axis, "
                                         "memory O(L/seq), causal work balanced zig-zag; ulysses: all-to-all to a "
                                         "head split, heads must divide by seq", check=one_of(ALGORITHMS))
    rules: dict | list | None = _mesh(None, "logical axis -> mesh axis rules; None = jaxpar.DEFAULT_RULES with FSDP",
                                      check=rules_check, flag=False)
    # --- pipeline: how a model's jaxpar.pipeline.Stack runs over the stage axis (cross checks: cli/pipelining.py) ---
    pipeline: str = _pipe(SCHEDULES[0], f"schedule of the stacked layers over the stage axis: {' | '.join(SCHEDULES)}; "
                          "with S stages, M --microbatches, R --repeats: gpipe: autodiff through the forward ticks, "
                          "activation memory grows with M; circular: R chunks of layers per stage, bubble "
                          "(S-1)/(RM+S-1); 1f1b: a forward and a backward alternate on every stage, at most S stage "
                          "inputs kept whatever M. Acts on a mesh with stage > 1 and a model with stacked layers (the "
                          "transformer)", check=one_of(SCHEDULES, noun="pipeline schedule"))
    microbatches: int = _pipe(1, "M pieces the batch is cut into on its way through the stacked layers; must divide "
                                 "the per-replica batch / --grad-accum; more microbatches shrink the bubble "
                                 "(S-1)/(M+S-1); with dropout on, part of the math (masks are drawn per microbatch, "
                                 "the same on every mesh)", check=_positive)
    repeats: int = _pipe(1, "R chunks of layers per stage under --pipeline circular (a smaller bubble); --layers "
                            "must divide by stages x R; R > 1 needs --microbatches >= stages", check=_positive)
    # --- model (per-model options and their defaults: models.REGISTRY) ---
    model: str = _arch(models.MODELS[0], f"built-in model: {_models}", check=one_of(models.MODELS, noun="model"))
    dtype: str = _arch("float32", "compute dtype float32 | bfloat16 (parameters and optimizer state stay float32)",
                       check=one_of(DTYPES))
    dropout: float = _arch(0.1, "dropout rate of the model", check=within(lambda v: 0 <= v < 1, "must be in [0, 1)"))
    layers: int | None = _arch(None, "transformer blocks", check=_positive)
    block: str | None = _arch(None, "transformer block: llama (RMSNorm, rotary positions, SwiGLU, no biases) | gpt "
                                    "(LayerNorm, learned positions, GELU: the unstacked model's, for its checkpoints)")
    d_model: int | None = _arch(None, "width of the residual stream", check=_positive)
    heads: int | None = _arch(None, "attention heads; must divide --d-model, and divide by the model-axis size",
                              check=_positive)
    d_ff: int | None = _arch(None, "transformer MLP width; must divide by the model-axis size", check=_positive)
    seq_len: int | None = _arch(None, "bytes (tokens) per training sequence", check=at_least(2))
    vocab: int | None = _arch(None, "vocabulary size, >= 256 for bytes; must divide by the model-axis size",
                              check=(at_least(2), within(lambda v: v >= 256, "byte-level text needs a vocabulary of "
                                                                             "at least 256")))
    hidden: int | None = _arch(None, "MLP hidden width", check=_positive)
    channels: tuple[int, int] | None = _arch(None, "CNN channels of its two conv layers", check=channels_check,
                                             flag=False)
    bn: str | None = _arch(None, f"BatchNorm statistics: {BN_SYNC} (global batch) | {BN_LOCAL} (each replica's slice)",
                           check=one_of((BN_SYNC, BN_LOCAL)),
                           default_text="sync, or local under a strategy whose replicas compute on their own slice")
    # --- data ---
    data: str | None = _data(None, "text file or folder to train on",
                             default_text="the Python standard library's .py files")
    batch_size: int = _data(32, "GLOBAL batch size, split evenly over the batch axes (data x fsdp)", check=_positive)
    # --- optimizer ---
    optimizer: str = _optim("adamw", f"{' | '.join(OPTIMIZERS)} (momentum: SGD with momentum 0.9, as in Goyal et al.)",
                            check=one_of(OPTIMIZERS))
    lr: float = _optim(3e-3, "peak learning rate", check=within(lambda v: v > 0, "must be > 0, e.g. --lr 1e-3"))
    weight_decay: float = _optim(0.0, "decoupled weight decay (adamw) or L2 added to the gradient (sgd / momentum)",
                                 check=within(lambda v: v >= 0, "must be >= 0"))
    lr_schedule: str = _optim("constant", f"{' | '.join(LR_SCHEDULES)}, after warmup", check=one_of(LR_SCHEDULES))
    warmup_steps: int = _optim(0, "gradual linear warmup from lr/W to lr over the first W steps", check=_count)
    lr_decay_steps: str | None = _optim(None, "step schedule: comma-separated decay steps",
                                        check=parses(parse_decay_steps), default_text="50% and 75% of --steps")
    lr_decay_factor: float = _optim(0.1, "step schedule: lr multiplier at each decay step",
                                    check=within(lambda v: 0 < v <= 1, "must be in (0, 1], e.g. 0.1"))
    # --- update strategy (which strategies an option applies to, and its default there: jaxpar.cli.strategies) ---
    # (default: the first of jaxpar.cli.strategies.ADAPTERS, synchronous SGD)
    strategy: str = _strategy(STRATEGIES[0], f"how replicas agree: {' | '.join(STRATEGIES)}",
                              check=one_of(STRATEGIES, noun="strategy"))
    allreduce: str | None = _strategy(None, f"gradient/parameter averaging: {' | '.join(ALLREDUCE_ALGORITHMS)}",
                                      check=parses(lambda value: check_allreduce(value, None)))
    torus: int | None = _strategy(None, "torus2d: X of the X x Y grid over the data axis", check=_positive,
                                  default_text="the divisor of the data-axis size nearest its square root")
    compress: str | None = _strategy(None, "gradient compression on the wire: none | bf16 | fp16 | int8 | powersgd:R "
                                           "(int8:noef, powersgd:R:noef: without error feedback)",
                                     check=parses(parse_codec))
    sync_period: int | None = _strategy(None, "local steps between meetings H", check=_positive)
    local_after: int | None = _strategy(None, "post-local SGD: synchronous for the first K steps", check=_count)
    outer_lr: float | None = _strategy(None, "outer Nesterov SGD learning rate",
                                       check=within(lambda v: v > 0, "must be > 0, e.g. --outer-lr 0.7"))
    outer_momentum: float | None = _strategy(None, "outer momentum",
                                             check=within(lambda v: 0 <= v < 1, "must be in [0, 1), e.g. 0.9"))
    staleness: int | None = _strategy(None, "largest staleness S of an applied gradient (0 = BSP)", check=_count)
    stragglers: str | None = _strategy(None, "simulated worker speeds (sets sim_time in the metrics); '3:2.0' = "
                                             "replica 3 is 2x slower; add ',jitter=0.1' for seeded log-normal jitter",
                                       check=parses(parse_stragglers),
                                       default_text="none given: every replica is equally fast")
    hardware: str | None = _strategy(None, f"price sim_time and --explain on a profile ({', '.join(PROFILES)}) or "
                                           "spec; or 'flops=FLOP/s,alpha=s,bandwidth=B/s' (per axis: data.alpha=..., "
                                           "model.bandwidth=...), or a profile name or PATH.json followed by such "
                                           "overrides (sustained=, devices_per_node=, inter.alpha=, inter.bandwidth=, "
                                           "nics=, allreduce=ring|hierarchical, overlap=0|1, bucket=, "
                                           "wire=float32|bfloat16|float16); also the peak of flops_utilization",
                                     check=(not_empty("a100-nvlink"), parses(parse_hardware)),
                                     default_text="none: every step costs 1, communication is free")
    # --- large-batch toolkit ---
    lr_scaling: str = _large("none", f"{' | '.join(LR_SCALINGS)}: lr x (global batch / --base-batch-size) or its root",
                             check=one_of(LR_SCALINGS))
    base_batch_size: int | None = _large(None, "the batch size --lr was tuned for", check=_positive,
                                         default_text="the first global batch size")
    batch_ramp: str | None = _large(None, "progressive global batch 'SIZE:FROM_STEP,...', e.g. '32:0,64:100'; "
                                          "replaces --batch-size; one compilation per size; lr follows --lr-scaling",
                                    check=parses(parse_batch_ramp))
    grad_accum: int = _large(1, "K microbatches per update (same update); must divide the per-replica batch",
                             check=_positive)
    label_smoothing: float = _large(0.0, "label smoothing eps: targets (1 - eps) one-hot + eps / classes",
                                    check=within(lambda v: 0 <= v < 1, "must be in [0, 1), e.g. 0.1"))
    # --- run ---
    steps: int = _run(300, "number of optimizer updates", check=_positive)
    seed: int = _run(0, "seed of initialisation, data order and dropout; same seed -> same run on any mesh",
                     check=within(lambda v: 0 <= v < 2 ** 32, "must be in [0, 2**32)"))
    read_ahead: int = _run(DEFAULT_READ_AHEAD, "global batches built ahead of the step in a background thread (0: "
                           "each built in the step's own thread); the next 2 batches' host-to-device copies stay in "
                           "flight either way", check=_count)
    log_every: int = _run(10, "print and log every K steps", check=_positive)
    metrics: str | None = _run(None, "write one JSON object per logged step (step, loss, ...) to this .jsonl file",
                               check=paths.metrics_check)
    tensorboard: str | None = _run(None, "also write every logged number as TensorBoard event files into this folder; "
                                         "tensorboardX; view with tensorboard --logdir FOLDER",
                                   check=paths.writable_folder("runs/"))
    profile: str | None = _run(None, "write a jax.profiler trace of the steps from START to STOP, e.g. 2:4 (the 3rd "
                                     "and 4th updates); viewable in TensorBoard's profile plugin or ui.perfetto.dev; "
                                     "each step marked jaxpar_step", check=parses(parse_profile))
    profile_dir: str | None = _run(None, "the folder --profile writes its trace into",
                                   check=paths.trace_folder("profile/"),
                                   default_text="the --tensorboard folder; else profile/ next to --metrics; else "
                                                "./profile")
    remat: str = _run(REMATS[0], f"rematerialization (recompute activations in the backward): {' | '.join(REMATS)}",
                      check=one_of(REMATS, noun="remat policy"))
    no_compile_cache: bool = _run(False, "do not use JAX's persistent compilation cache (default folder: "
                                         "$JAXPAR_COMPILE_CACHE or ~/.cache/jaxpar/xla)")
    explain: bool = _run(False, "print the sharding plan, memory, collectives and FLOPs, then exit without training; "
                                "of every step variant (with --hardware: projected step times)")
    plan: bool = _run(False, "rank meshes x strategies x remat on --hardware for --devices devices (projected step "
                             "time, memory), print the flags of the best, then exit without training")
    devices: int | None = _run(None, "with --plan: the number of devices to plan for (default: as many as --mesh uses)",
                               check=_positive)
    eval_every: int = _run(0, "evaluate on the held-out split every N steps (0: only at the end)", check=_count)
    eval_batches: int = _run(4, "held-out batches per evaluation (text; digits: the whole test split)", check=_count)
    # --- checkpoints and numerical faults ---
    checkpoint_dir: str | None = _faults(None, "save checkpoints here (orbax: sharded, asynchronous, atomic); the "
                                               "latest --keep are kept; SIGTERM / Ctrl-C then saves one and exits 0",
                                         check=paths.writable_folder("checkpoints/"))
    checkpoint_every: int = _faults(100, "save a checkpoint every N steps (and at the end)", check=_positive)
    keep: int = _faults(3, "checkpoints kept in --checkpoint-dir (older ones are deleted)", check=_positive)
    resume: str | None = _faults(None, "continue from the latest checkpoint in --checkpoint-dir; '--resume' starts "
                                       "fresh (saying so) when there is none, '--resume required' refuses to",
                                 check=one_of(("auto", "required")), const="auto", default_text="off")
    resume_step: int | None = _faults(None, "with --resume: continue from this checkpoint step instead of the latest",
                                      check=_count)
    on_nonfinite: str = _faults("skip", "a step whose loss or updated state is not finite: skip | abort; skip: the "
                                        "state stays bit-identical, counted in skipped_steps",
                                check=one_of(("skip", "abort")))
    max_skips: int = _faults(10, "abort after more than this many consecutive skipped steps", check=_count)
    check_every: int = _faults(100, "compare every device's copy of the replicated parameters every N steps; 0: "
                                    "never; a fingerprint, at the start and every N steps", check=_count)
    # --- several processes (jaxpar.runtime.distributed); python -m jaxpar.launch sets them through the environment ---
    runtime: str = _procs(RUNTIMES[0], "emulated: one SPMD program, asynchrony emulated exactly (simulated time) | ray: "
                                       "each data-axis index a Ray actor process, a parameter server, real wall-clock "
                                       "asynchrony (pip install 'jaxpar[ray]')", check=one_of(RUNTIMES))
    ray_address: str | None = _procs(None, "with --runtime ray: HOST:PORT of a running Ray head (ray start --head), or "
                                           "'auto'", check=not_empty("10.0.0.1:6379"),
                                     default_text="a local Ray instance started for the run")
    max_restarts: int | None = _procs(None, "with --runtime ray: times Ray restarts a worker process that dies (it "
                                            "rejoins from the current parameters)", check=_count, default_text="0")
    server_shards: int | None = _procs(None, "with --runtime ray: actors the parameter server's parameters and "
                                             "optimizer are split over, by bytes (pushes and pulls go to each "
                                             "directly)", check=_positive, default_text="1")
    coordinator: str | None = _procs(None, "HOST:PORT of process 0 (the same on every process); for a run over "
                                           "several processes / hosts; with --num-processes and --process-id",
                                     check=coordinator_check,
                                     default_text="one process, or from the environment (jaxpar.launch, SLURM)")
    num_processes: int | None = _procs(None, "processes in the run (each with mesh size / N devices)", check=_positive)
    process_id: int | None = _procs(None, "this process's rank, 0 .. N-1 (process 0 prints, logs and writes)",
                                    check=_count)

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def applies(self, name: str) -> bool:
        """Whether option `name` applies to this config's model and strategy."""
        return defaults.applies(self, name)

    def resolved(self) -> "Config":
        """A copy with every unset (None) option that applies replaced by its default (`jaxpar.cli.defaults`)."""
        return defaults.resolved(self)

    def validate(self) -> "Config":
        """Self, or a `ConfigError` naming the flag, the value and what would work (`jaxpar.cli.validation`)."""
        validation.validate(self)
        return self

    def resume_differences(self, saved: Mapping) -> list[str]:
        """The options a resumed run may not change that differ from `saved` (`jaxpar.cli.compat`)."""
        return compat.resume_differences(self, saved)

    def decay_steps(self) -> tuple[int, ...] | None:
        return None if self.lr_decay_steps is None else parse_decay_steps(self.lr_decay_steps)

    def to_record(self) -> dict:
        """The full resolved config as a JSON-serialisable dict, plus {"versions": ...} (`jaxpar.cli.records`)."""
        return records.to_record(self)

    @classmethod
    def from_record(cls, record: Mapping) -> "Config":
        """The Config of a `to_record()` dict (`jaxpar.cli.records`)."""
        return records.from_record(cls, record)


OPTIONS: dict[str, Option] = declared(Config)  # option -> its declaration
