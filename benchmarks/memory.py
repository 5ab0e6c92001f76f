"""Per-device memory against the mesh: the train state's bytes per device and the compiled step's, no training.

    python -m benchmarks.memory                                   # default transformer and the digits MLP, 5 meshes
    python -m benchmarks.memory --models transformer --meshes "fsdp=8;2x4"

For each model (the default transformer, `jaxpar.cli.Config().resolved()`: 2 blocks, d_model 128, 4 heads, d_ff 512,
seq_len 128, batch 32; and the digits MLP, hidden 128, batch 32; both with adamw) and each mesh of `--meshes`
(default 8, 1x8, fsdp=8, 2x4, data=2,fsdp=2,model=2), a `jaxpar.Trainer` is built and `jaxpar.explain` compiles its
sync step ahead of time on a real batch from `jaxpar.io.data`; nothing is allocated and nothing trains. Reported:

- state / dev: the train state's bytes on one device (parameters + optimizer state; the strategy and communicator
  state, empty for `Sync()`), from `explain`'s `plan.per_device["all"]`, split into its replicated and sharded part;
  `Trainer.state_bytes_per_device()` (the fullest device, also counting the step counter and the run key) is
  printed next to it as a cross-check;
- state total: the bytes of the whole train state (every leaf unsharded), the same on every mesh;
- dev / total: state per device / state total; 1.0 when everything is replicated (mesh 8), about 1 / (fsdp x model)
  when everything is split; the replicated leaves (biases and LayerNorm parameters that no rule splits, or whose
  dimensions do not divide) keep it above that;
- sharded dev / total: the sharded part on one device / the unsharded bytes of those same leaves: exactly
  1 / (the ways they are split) when every sharded leaf is split over the same axes (1/8 on 1x8 and fsdp=8);
- step / dev: the compiled sync step's per-device memory by XLA's memory analysis (`explain(...)["variants"]
  ["sync"]["memory"]["total"]`: arguments + outputs - donated + temporaries), i.e. the state plus the batch shard,
  gradients and activations.

A mesh the model's dimensions do not divide (e.g. 1x8 for the 4-head transformer: tensor parallelism splits heads
over `model`) is skipped with one printed line saying why. Then the check: on 1x8 and fsdp=8 the sharded part
should be 1/8 per device (printed, never asserted). One JSON line per (model, mesh) follows, skipped ones included.
"""

import argparse
import json
import math
import time

import jaxpar
from jaxpar.train.batches import indivisible_batch
from benchmarks import common

MESHES = ("8", "1x8", "fsdp=8", "2x4", "data=2,fsdp=2,model=2")
MODELS = ("transformer", "mlp")
CHECKED = ("1x8", "fsdp=8")  # meshes that should hold 1/8 of the sharded state per device


def itemsize(dtype) -> int:
    """Bytes of one element, PRNG key dtypes included (as `jaxpar.explain` counts them)."""
    import numpy as np

    return int(getattr(dtype, "itemsize", 0) or np.dtype(dtype).itemsize)


def total_bytes(tree) -> int:
    """Bytes of a tree of ShapeDtypeStructs, every leaf whole."""
    import jax

    return sum(math.prod(x.shape) * itemsize(x.dtype) for x in jax.tree.leaves(tree))


def sharded_leaves_total(tree) -> int:
    """Whole bytes of the leaves of a placed abstract tree whose shard on a device is smaller than the leaf."""
    import jax

    out = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and tuple(sharding.shard_shape(leaf.shape)) != tuple(leaf.shape):
            out += math.prod(leaf.shape) * itemsize(leaf.dtype)
    return out


def measure(model, spec, parts: common.Setup):
    import jax

    base = {"model": model, "mesh": spec}
    try:
        mesh = jaxpar.make_mesh(spec)
        trainer = common.trainer(parts, mesh)
        problem = indivisible_batch(parts.config.batch_size, trainer.batch_divisor)
        if problem:
            raise jaxpar.ConfigError(problem)
        start = time.perf_counter()
        report = jaxpar.explain(trainer, parts.batch)
        seconds = time.perf_counter() - start
    except jaxpar.JaxparError as error:
        return {**base, "skipped": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    state = trainer.abstract_state()
    plan = report["plan"]["per_device"]
    fields = ("params", "model_state", "opt_state", "strategy_state", "comm_state")
    state_total = sum(total_bytes(getattr(state, f)) for f in fields)
    sharded_total = sum(sharded_leaves_total(getattr(state, f)) for f in fields)
    memory = report["variants"]["sync"]["memory"] or {}
    row = {**base, "mesh_shape": dict(mesh.shape), "parameters": report["parameters"],
           "param_bytes_per_device": plan["parameters"]["total"],
           "optimizer_bytes_per_device": plan["optimizer"]["total"],
           "state_bytes_per_device": plan["all"]["total"],
           "state_replicated_bytes_per_device": plan["all"]["replicated"],
           "state_sharded_bytes_per_device": plan["all"]["sharded"],
           "trainer_state_bytes_per_device": trainer.state_bytes_per_device(),
           "state_bytes_total": state_total, "sharded_leaves_bytes_total": sharded_total,
           "ratio": plan["all"]["total"] / state_total,
           "sharded_ratio": plan["all"]["sharded"] / sharded_total if sharded_total else None,
           "step_bytes_per_device": memory.get("total"),
           "step_arguments": memory.get("arguments"), "step_outputs": memory.get("outputs"),
           "step_temporaries": memory.get("temporaries"), "step_donated": memory.get("donated"),
           "device_memory": report["device_memory"], "explain_seconds": seconds}
    del trainer, report
    jax.clear_caches()
    return row


def fraction(value):
    """'1/8.00 (0.1250)' for a ratio."""
    return "-" if not value else f"1/{1 / value:.2f} ({value:.4f})"


def print_table(model, rows):
    print(f"\n{model}: train state (params + adamw state) and compiled sync step, bytes per device")
    print("| mesh | params / dev | opt / dev | state / dev (replicated + sharded) | state total | dev / total | "
          "sharded dev / total | step / dev (args + out - donated + temp) |")
    print("|---" * 8 + "|")
    for r in rows:
        if "skipped" in r:
            print(f"| `{r['mesh']}` | skipped: {r['skipped']} |" + " |" * 6)
            continue
        step = (f"{r['step_bytes_per_device']:,} ({r['step_arguments']:,} + {r['step_outputs']:,} - "
                f"{r['step_donated']:,} + {r['step_temporaries']:,})" if r["step_bytes_per_device"] is not None
                else "n/a")
        print(f"| `{r['mesh']}` | {r['param_bytes_per_device']:,} | {r['optimizer_bytes_per_device']:,} | "
              f"{r['state_bytes_per_device']:,} ({r['state_replicated_bytes_per_device']:,} + "
              f"{r['state_sharded_bytes_per_device']:,}) | {r['state_bytes_total']:,} | {fraction(r['ratio'])} | "
              f"{fraction(r['sharded_ratio'])} | {step} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--meshes", default=";".join(MESHES), help="mesh specs separated by ';'")
    args = parser.parse_args()
    chosen = [m.strip() for m in args.models.split(",") if m.strip()]
    for model in chosen:
        if model not in MODELS:
            parser.error(f"--models: {model!r} is not one of {', '.join(MODELS)}")
    specs = [s.strip() for s in args.meshes.split(";") if s.strip()]
    if not specs:
        parser.error("--meshes: empty")
    jaxpar.make_mesh("8")  # before anything touches JAX: provides the 8 CPU devices

    start = time.perf_counter()
    rows = []
    for model in chosen:
        parts = common.setup(model)  # the config's defaults
        model_rows = []
        for spec in specs:
            row = measure(model, spec, parts)
            if "skipped" in row:
                print(f"{model} on mesh {spec}: skipped, {row['skipped']}", flush=True)
            else:
                print(f"{model} on mesh {spec}: {row['state_bytes_per_device']:,} state bytes per device of "
                      f"{row['state_bytes_total']:,} ({row['explain_seconds']:.1f} s)", flush=True)
            model_rows.append(row)
        print_table(model, model_rows)
        rows += model_rows

    print("\ncheck: the sharded part of the state per device on 1x8 and fsdp=8 (expected 1/8 = 0.1250)")
    for r in rows:
        if r["mesh"] not in CHECKED:
            continue
        if "skipped" in r:
            print(f"  {r['model']:12s} {r['mesh']:8s} skipped ({r['skipped']})")
            continue
        near = r["sharded_ratio"] is not None and abs(r["sharded_ratio"] - 1 / 8) < 0.01
        print(f"  {r['model']:12s} {r['mesh']:8s} sharded part {fraction(r['sharded_ratio'])}: "
              f"{'OK' if near else 'NOT 1/8'}; whole state {fraction(r['ratio'])} per device "
              f"({r['state_replicated_bytes_per_device']:,} bytes replicated on every device)")
    for r in rows:
        print(json.dumps(r))
    print(f"total {time.perf_counter() - start:.1f} s")


def summarize(rows):
    """The suite's summary cell (`python -m benchmarks`) from this script's JSON rows."""
    lines = ["train state per device / total (sharded part per device / its total):"]
    for model in dict.fromkeys(r["model"] for r in rows):
        cells = []
        for r in (r for r in rows if r["model"] == model):
            if "skipped" in r:
                cells.append(f"`{r['mesh']}` skipped")
            else:
                sharded = f" ({r['sharded_ratio']:.4f})" if r.get("sharded_ratio") else ""
                cells.append(f"`{r['mesh']}` **{r['ratio']:.4f}**{sharded}")
        lines.append(f"{model}: " + ", ".join(cells))
    return lines


if __name__ == "__main__":
    main()
