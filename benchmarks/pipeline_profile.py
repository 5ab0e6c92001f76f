"""What the pipeline schedules really execute: busy time per tick from a `jax.profiler` trace of the running step,
against the FLOPs `--explain` counts for the same compiled step.

    python -m benchmarks.pipeline_profile                          # small and head configs, gpipe / circular / 1f1b
    python -m benchmarks.pipeline_profile --configs head --schedules gpipe,1f1b --microbatches 8

Each row is one `jaxpar.Trainer` (the built-in transformer, adamw, dropout 0) on `stage=4`: `jaxpar.explain` counts
its step's FLOPs per device (a conditional counted at the branch that runs: the pipeline page's rule), then the step
runs `--warmup` times and `--steps` more under `jax.profiler.trace` (Python tracer off). In the trace (perfetto
JSON) every XLA:CPU operation is an event naming its device; a device's compute time is the summed durations of its
innermost operations less collectives (whose time includes waiting for the other devices), per step. A tick is one
of the schedule's 2 (M + S - 1) slots (GPipe: forward and backward ticks; 1F1B: half-steps; circular:
2 (R M + S - 1)). If the count follows what runs, the busiest device's compute time per counted FLOP is about the
same for every schedule of one config; counting a branch that never runs shows as fewer milliseconds per counted
GFLOP. The devices share this machine's cores, so absolute times are inflated alike. One JSON line per row.

Configs: `small` (8 blocks, d_model 128, seq 128, vocab 256; the head 1/16 of a stage) and `head` (the same with
vocab 8,192: a head of about 2.7 stages' FLOPs, so counting or running it once more per tick shows).
"""

import argparse
import glob
import gzip
import json
import os
import tempfile
import time

import jaxpar
from benchmarks import common

CONFIGS = {"small": dict(layers=8, d_model=128, seq_len=128, vocab=256),
           "head": dict(layers=8, d_model=128, seq_len=128, vocab=8192)}
COLLECTIVES = ("ppermute", "collective-permute", "all-reduce", "all-gather", "all-to-all", "reduce-scatter", "psum",
               "collective")


def device_busy(events) -> dict[int, tuple[float, float]]:
    """Per device ordinal, (busy, compute) microseconds: the summed durations of the innermost operation events
    (those naming an `hlo_op` and a `device_ordinal`; a while or conditional encloses its body's), all of them and
    less collectives (whose time includes waiting for the other devices)."""
    by_thread: dict = {}
    for e in events:
        args = e.get("args", {})
        if e.get("ph") == "X" and e.get("dur", 0) > 0 and "hlo_op" in args and "device_ordinal" in args \
                and not e["name"].startswith("end: "):
            by_thread.setdefault((e["pid"], e.get("tid")), []).append(e)
    out: dict[int, list[float]] = {}
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        for k, e in enumerate(thread):
            following = thread[k + 1] if k + 1 < len(thread) else None
            if following is not None and following["ts"] + following["dur"] <= e["ts"] + e["dur"] + 0.01:
                continue  # encloses the next operation (to 0.01 us: the trace's rounding): not innermost
            sums = out.setdefault(int(e["args"]["device_ordinal"]), [0.0, 0.0])
            sums[0] += e["dur"]
            if not any(word in e["name"] for word in COLLECTIVES):
                sums[1] += e["dur"]
    return {device: (busy, compute) for device, (busy, compute) in sorted(out.items())}


def worker_events(trace_folder: str) -> list[dict]:
    """The trace's complete events on XLA's CPU worker threads (where the compiled operations run)."""
    (path,) = glob.glob(os.path.join(trace_folder, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    workers = {key for key, name in names.items() if "XLAEigen" in name or "XLAPjRtCpuClient" in name}
    return [e for e in events if (e.get("pid"), e.get("tid")) in workers]


def measure(name, schedule, count, rows, stages, warmup, steps, keep=None):
    import jax

    fields = dict(CONFIGS[name], dropout=0.0, batch_size=count * rows)
    parts = common.setup("transformer", **fields)
    repeats = 2 if schedule == "circular" else 1
    pipeline = jaxpar.Pipeline(schedule, microbatches=count, repeats=repeats)
    trainer = common.trainer(parts, jaxpar.make_mesh(f"stage={stages}"), pipeline=pipeline)
    flops = jaxpar.explain(trainer, parts.batch)["variants"]["sync"]["flops_per_device"]
    state, batch = trainer.init(0), trainer.shard_batch(parts.batch)
    for _ in range(warmup):
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics["loss"])
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with tempfile.TemporaryDirectory() as scratch:
        folder = os.path.join(keep, f"{name}-{schedule}-{count}") if keep else scratch
        start = time.perf_counter()
        with jax.profiler.trace(folder, create_perfetto_trace=True, profiler_options=options):
            for _ in range(steps):
                state, metrics = trainer.step(state, batch)
                jax.block_until_ready(metrics["loss"])
        wall = (time.perf_counter() - start) / steps
        devices = device_busy(worker_events(folder))
    if len(devices) != stages:
        raise SystemExit(f"the trace names operations on {len(devices)} devices, not the {stages} stages: this reader "
                         f"knows XLA:CPU's traces (JAX_PLATFORMS=cpu)")
    ticks = 2 * (repeats * count + stages - 1)
    per_step = 1e-3 / steps  # microseconds over the traced steps -> milliseconds per step
    compute = [c * per_step for _, c in devices.values()]
    row = {"config": name, "schedule": schedule, "microbatches": count, "repeats": repeats, "ticks": ticks,
           "flops_per_device": flops, "compute_ms_per_device": compute,
           "busy_ms_per_device": [b * per_step for b, _ in devices.values()], "compute_ms": max(compute),
           "wall_ms": wall * 1e3}
    row["compute_ms_per_tick"] = row["compute_ms"] / ticks
    row["compute_ms_per_gflop"] = row["compute_ms"] / (flops / 1e9)
    del trainer, state
    jax.clear_caches()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="small,head")
    parser.add_argument("--schedules", default="gpipe,circular,1f1b")
    parser.add_argument("--microbatches", default="8")
    parser.add_argument("--rows", type=int, default=4, help="rows per microbatch")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="traced steps")
    parser.add_argument("--keep", help="write each row's trace into a folder of this one (else a temporary one)")
    args = parser.parse_args()
    jaxpar.make_mesh(f"stage={args.stages}")  # before anything touches JAX: provides the CPU devices
    rows = []
    for name in args.configs.split(","):
        for count in (int(m) for m in args.microbatches.split(",")):
            for schedule in args.schedules.split(","):
                row = measure(name, schedule, count, args.rows, args.stages, args.warmup, args.steps, args.keep)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("| config | schedule | M | ticks | counted GFLOP per device | compute ms, busiest device | per tick | "
          "ms per counted GFLOP | compute ms per device | wall ms per step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['schedule']} | {r['microbatches']} | {r['ticks']} | "
              f"{r['flops_per_device'] / 1e9:.2f} | {r['compute_ms']:.1f} | {r['compute_ms_per_tick']:.2f} | "
              f"{r['compute_ms_per_gflop']:.2f} | {' / '.join(f'{c:.0f}' for c in r['compute_ms_per_device'])} | "
              f"{r['wall_ms']:.0f} |")


def summarize(rows):
    """The suite's summary cell (`python -m benchmarks`) from this script's JSON rows."""
    out = []
    for name in dict.fromkeys(r["config"] for r in rows):
        by = {r["schedule"]: r for r in rows if r["config"] == name}
        if "gpipe" in by and "1f1b" in by:
            g, o = by["gpipe"], by["1f1b"]
            out.append(f"{name}: 1F1B / GPipe counted FLOPs {o['flops_per_device'] / g['flops_per_device']:.3f}, "
                       f"compute time {o['compute_ms'] / g['compute_ms']:.3f}")
    return out


if __name__ == "__main__":
    main()
