"""Compiled temporaries and FLOPs per device of the transformer's pipelined training step against the microbatch
count, at a fixed number of rows per microbatch, and a data-parallel step at the same global batch.

    python -m benchmarks.pipeline_memory                       # both configs below, gpipe / circular / 1f1b / data=4
    python -m benchmarks.pipeline_memory --configs small --schedules gpipe,1f1b --microbatches 4,16

Configs: `small` (8 blocks, d_model 128, seq 128, vocab 256) and `vocab` (8 blocks, d_model 256, seq 256, vocab
32,768: a head as large as a stage). Each row is one `jaxpar.Trainer` (adamw, dropout 0) on `stage=4` (or `data=4`)
whose sync step `jaxpar.explain` compiles ahead of time on a real batch of M x `--rows` rows; nothing trains.
Reported as `python run.py --explain` prints them: XLA's temporaries per device and the counted FLOPs per device.
Circular runs 2 repeats (16 blocks would be needed for more). One JSON line per row.
"""

import argparse
import json
import time

import jaxpar
from benchmarks import common

CONFIGS = {"small": dict(layers=8, d_model=128, seq_len=128, vocab=256),
           "vocab": dict(layers=8, d_model=256, seq_len=256, vocab=32768)}


def measure(name, schedule, count, rows, stages):
    import jax

    fields = dict(CONFIGS[name], dropout=0.0, batch_size=count * rows)
    parts = common.setup("transformer", **fields)
    if schedule == "data":
        mesh, pipeline = jaxpar.make_mesh(f"data={stages}"), None
    else:
        mesh = jaxpar.make_mesh(f"stage={stages}")
        pipeline = jaxpar.Pipeline(schedule, microbatches=count, repeats=2 if schedule == "circular" else 1)
    start = time.perf_counter()
    trainer = common.trainer(parts, mesh, pipeline=pipeline)
    report = jaxpar.explain(trainer, parts.batch)
    sync = report["variants"]["sync"]
    row = {"config": name, "schedule": schedule, "microbatches": count, "rows_per_microbatch": rows,
           "batch": count * rows, "temporaries": (sync["memory"] or {}).get("temporaries"),
           "flops_per_device": sync.get("flops_per_device"), "seconds": round(time.perf_counter() - start, 1)}
    del trainer, report
    jax.clear_caches()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="small,vocab")
    parser.add_argument("--schedules", default="gpipe,circular,1f1b,data", help="pipelines, and data (data=4)")
    parser.add_argument("--microbatches", default="4,8,16,32")
    parser.add_argument("--rows", type=int, default=4, help="rows per microbatch")
    parser.add_argument("--stages", type=int, default=4)
    args = parser.parse_args()
    jaxpar.make_mesh(f"stage={args.stages}")  # before anything touches JAX: provides the CPU devices
    for name in args.configs.split(","):
        for count in (int(m) for m in args.microbatches.split(",")):
            for schedule in args.schedules.split(","):
                row = measure(name, schedule, count, args.rows, args.stages)
                print(f"{name:6s} {schedule:9s} M={count:3d} batch={row['batch']:4d}: temporaries "
                      f"{row['temporaries']:>14,}  FLOPs per device {row['flops_per_device']:>18,}", flush=True)
                print(json.dumps(row), flush=True)


def summarize(rows):
    """The suite's summary cell (`python -m benchmarks`) from this script's JSON rows."""
    out = []
    for name in dict.fromkeys(r["config"] for r in rows):
        by = {(r["schedule"], r["microbatches"]): r["temporaries"] for r in rows if r["config"] == name}
        counts = sorted({m for _, m in by})
        if ("1f1b", counts[0]) in by and ("1f1b", counts[-1]) in by:
            grow = by["1f1b", counts[-1]] / by["1f1b", counts[0]]
            out.append(f"{name}: 1F1B temporaries x{grow:.2f} from M={counts[0]} to M={counts[-1]}")
    return out


if __name__ == "__main__":
    main()
