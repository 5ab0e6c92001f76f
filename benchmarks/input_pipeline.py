"""The input pipeline: host time per global batch, the old per-example index path against the vectorized one, and
the digits MLP's steps/s fed by run.py's pipeline against the same trainer fed from batches already on the devices.

    python -m benchmarks.input_pipeline                                 # both parts
    python -m benchmarks.input_pipeline --part host --sizes 512,4096 --seconds 0.5
    python -m benchmarks.input_pipeline --part steps --rounds 5 --steps 100
    python -m benchmarks.input_pipeline --part steps --model transformer --mesh 2x4 --batch-size 32 --steps 10

Part `host` (no device work): for each source and global batch size, the milliseconds one call of `next` takes
(median over as many calls as fit in --seconds, at least 2; the batch that computes a new epoch's order is
rarely the median: that cost, once per epoch, is its own column), built in the calling thread:
- `old`: what `Batches.__next__` did before the index stream: grain's `MapDataset.range(n).shuffle(seed).repeat()`
  asked for one index at a time in a Python loop, then the source for those examples;
- `new`: `Batches.__next__` (`jaxpar.io.index_stream`: the epoch's order as one numpy array, one gather per batch).
Sources: `digits` (the training split, tiled to hold the largest batch: 22x its 1,497 examples for 32,768),
`text` (run.py's
corpus on disk, the first 8 MiB of the default corpus, windows of 129 bytes read with os.pread as a run reads
them), `synthetic` (65,536 random digits-shaped examples in memory).

Part `steps`: the trainer `run.py --model M --mesh X --batch-size B` builds (`jaxpar.cli.build`; default
`--model mlp --mesh 8 --batch-size 512`), its `Trainer.fit` fed four ways in alternating rounds (--rounds rounds of
--steps steps, the median steps/s):
- `device`: one global batch already placed on the devices, repeated (the overhead benchmark's jaxpar figure);
- `run.py`: run.py's pipeline (`Batches` with 2 batches read ahead in a thread, `prefetch_to_device` of 2);
- `inline`: `--read-ahead 0` (each batch built in the main thread) under the same device prefetch;
- `old`: the old path (grain per example, in the main thread) under the same device prefetch.

Part `workers` (how batches are built ahead): the consumer's milliseconds per `next` (median and mean of 200, with
2 ms of sleep between calls standing in for a step) for digits tiled 22x (32,934 examples): `Batches(read_ahead=2)`
(a thread), grain's `mp_prefetch` with 1 worker process (each record one vectorized batch), and no read-ahead.
Prints markdown tables and one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import numpy as np

SIZES = (512, 4096, 32768)
TEXT_BYTES = 8 << 20  # 63,000 training windows of 129 bytes: more than the largest batch
SEQ_LEN = 128


class OldBatches:
    """`Batches.__next__` as it was: grain's index stream one index at a time (kept here to measure against)."""

    def __init__(self, source, batch_size: int, seed: int):
        import grain

        self.source, self.size = source, batch_size
        self.order = grain.MapDataset.range(len(source)).shuffle(seed=seed).repeat(None)
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self):
        indices = np.fromiter((self.order[self.position + k] for k in range(self.size)), np.int64, self.size)
        self.position += self.size
        return self.source[indices]

    def get_state(self):
        return {"position": self.position}


def sources(largest: int) -> dict:
    from jaxpar.io import data

    train, _ = data.load_digits()
    copies = -(-largest // len(train["label"]))
    digits = {k: np.concatenate([v] * copies) for k, v in train.items()} if copies > 1 else train
    text, _ = data.split_corpus(data.open_corpus(None, TEXT_BYTES), seq_len=SEQ_LEN)
    return {"digits": data.ArraySource(digits), "text": data.TextWindows(text, SEQ_LEN),
            "synthetic": data.ArraySource(synthetic_images(max(65536, largest)))}


def synthetic_images(size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random digits-shaped examples held in memory: float32 images [size, 8, 8, 1] and int32 labels [size]."""
    rng = np.random.default_rng(seed)
    return {"image": rng.random((size, 8, 8, 1), dtype=np.float32),
            "label": rng.integers(0, 10, size, dtype=np.int32)}


def time_per_batch(batches, seconds: float) -> float:
    """Median milliseconds of one `next(batches)`, over the calls that fit in `seconds` (at least 2)."""
    times, start = [], time.perf_counter()
    while len(times) < 2 or time.perf_counter() - start < seconds:
        begin = time.perf_counter()
        next(batches)
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def host_part(args) -> list[dict]:
    from jaxpar.io import data

    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    from jaxpar.io.index_stream import IndexStream

    for name, source in sources(max(sizes)).items():
        begin = time.perf_counter()
        IndexStream(len(source), seed=1).epoch(0)
        epoch_ms = (time.perf_counter() - begin) * 1e3
        for size in sizes:
            new = data.Batches(source, size, seed=0, name=name)
            next(new)  # the first epoch's order is computed once per epoch: not a per-batch cost
            row = {"part": "host", "source": name, "examples": len(source), "batch": size, "epoch_order_ms": epoch_ms,
                   "new_ms": time_per_batch(new, args.seconds),
                   "old_ms": time_per_batch(OldBatches(source, size, 0), args.seconds)}
            row["speedup"] = row["old_ms"] / row["new_ms"]
            rows.append(row)
    print("| source | examples | global batch | old: grain per example (ms) | new: vectorized (ms) | speedup | "
          "an epoch's order, once per epoch (ms) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['source']} | {r['examples']:,} | {r['batch']:,} | {r['old_ms']:.3f} | {r['new_ms']:.3f} | "
              f"{r['speedup']:.0f}x | {r['epoch_order_ms']:.1f} |")
    return rows


FEEDS = (("device", "device-resident batch"), ("run.py", "run.py: read ahead 2 + device prefetch"),
         ("inline", "--read-ahead 0: built in the main thread + device prefetch"),
         ("old", "old: grain per example, main thread"))


def steps_part(args) -> list[dict]:
    import jaxpar
    from benchmarks import common
    from jaxpar.cli import Config
    from jaxpar.cli.build import build
    from jaxpar.io import data

    jaxpar.make_mesh(args.mesh)  # the CPU devices, before JAX starts
    config = Config(model=args.model, mesh=args.mesh, batch_size=args.batch_size).resolved().validate()
    built = build(config)
    trainer, source = built.trainer, built.train_batches.source
    state = trainer.init(config.seed)
    resident = trainer.shard_batch(next(data.Batches(source, args.batch_size, seed=1)))
    feeds = {"device": itertools.repeat(resident),
             "run.py": data.prefetch_to_device(built.train_batches, trainer.shard_batch),
             "inline": data.prefetch_to_device(data.Batches(source, args.batch_size, config.seed), trainer.shard_batch),
             "old": data.prefetch_to_device(OldBatches(source, args.batch_size, config.seed), trainer.shard_batch)}

    def runner(feed):
        def run(n):
            nonlocal state
            state = trainer.fit(state, feed, n)
        return run

    rates = common.alternating_rates({name: runner(feed) for name, feed in feeds.items()}, args.rounds, args.steps,
                                     runs=True)
    feeds["run.py"].close()
    row = {"part": "steps", "model": args.model, "mesh": args.mesh, "batch": args.batch_size, "rounds": args.rounds,
           "steps_per_round": args.steps, **{f"{k}_steps_per_sec": statistics.median(v) for k, v in rates.items()}}
    for name in ("run.py", "inline", "old"):
        row[f"{name.replace('.', '_')}_over_device"] = row[f"{name}_steps_per_sec"] / row["device_steps_per_sec"]
    row["round_ratios"] = [a / b for a, b in zip(rates["run.py"], rates["device"])]
    print(f"\n| feed ({args.model}, mesh {args.mesh}, global batch {args.batch_size}) | steps/s (median of "
          f"{args.rounds}) | of device-resident |")
    print("|---|---|---|")
    for name, label in FEEDS:
        value = row[f"{name}_steps_per_sec"]
        print(f"| {label} | {value:.2f} | {value / row['device_steps_per_sec']:.3f} |")
    print("run.py / device per round: " + ", ".join(f"{r:.3f}" for r in row["round_ratios"]))
    return [row]


class _OneBatchPerRecord:
    """A grain source whose record k is batch k of `Batches` (for grain's worker processes to build)."""

    def __init__(self, source, size):
        self.source, self.size = source, size

    def __len__(self):
        return 1 << 40

    def __getitem__(self, k):
        from jaxpar.io import data

        batches = data.Batches(self.source, self.size, seed=0)
        batches.set_state({"position": k * self.size, "step": k})
        return next(batches)


def workers_part(args) -> list[dict]:
    import absl.flags
    import grain

    from jaxpar.io import data

    absl.flags.FLAGS.mark_as_parsed()  # grain's worker processes read absl flags

    def consumer_ms(batches, count=200):
        next(batches)
        times = []
        for _ in range(count):
            begin = time.perf_counter()
            next(batches)
            times.append(time.perf_counter() - begin)
            time.sleep(0.002)
        return statistics.median(times) * 1e3, statistics.mean(times) * 1e3

    sizes = [int(s) for s in args.sizes.split(",") if int(s) <= 4096]
    source = sources(32768)["digits"]  # 32,934 examples: an epoch every 8 batches of 4,096 at most
    rows = []
    for size in sizes:
        with data.Batches(source, size, seed=0, read_ahead=2) as thread:
            timed = {"thread": consumer_ms(thread)}
        pool = grain.MapDataset.source(_OneBatchPerRecord(source, size)).to_iter_dataset().mp_prefetch(
            grain.multiprocessing.MultiprocessingOptions(num_workers=1, per_worker_buffer_size=2))
        workers = iter(pool)
        timed["grain_workers"] = consumer_ms(workers)
        workers.close()
        timed["inline"] = consumer_ms(data.Batches(source, size, seed=0))
        rows.append({"part": "workers", "batch": size, **{f"{k}_median_ms": v[0] for k, v in timed.items()},
                     **{f"{k}_mean_ms": v[1] for k, v in timed.items()}})
    print("\n| digits x22, global batch | thread read-ahead: median / mean (ms) | grain mp_prefetch, 1 worker | "
          "no read-ahead |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']:,} | " + " | ".join(f"{r[k + '_median_ms']:.3f} / {r[k + '_mean_ms']:.3f}"
                                                   for k in ("thread", "grain_workers", "inline")) + " |")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["host", "steps", "workers", "both"], default="both",
                        help="both: host and steps")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="global batch sizes, comma-separated")
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measured (source, size, path)")
    parser.add_argument("--batch-size", type=int, default=512, help="part steps: run.py's --batch-size")
    parser.add_argument("--model", default="mlp", help="part steps: run.py's --model")
    parser.add_argument("--mesh", default="8", help="part steps: run.py's --mesh")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100, help="part steps: steps per round")
    args = parser.parse_args()
    rows = []
    if args.part in ("host", "both"):
        rows += host_part(args)
    if args.part in ("steps", "both"):
        rows += steps_part(args)
    if args.part == "workers":
        rows += workers_part(args)
    for row in rows:
        print(json.dumps(row))


def summarize(rows):
    """The suite's summary cell (`python -m benchmarks`) from this script's JSON rows."""
    lines = [f"{r['source']} {r['batch']:,}: {r['new_ms']:.3f} ms (old {r['old_ms']:.2f})"
             for r in rows if r.get("part") == "host"]
    lines += [f"{r['model']} mesh {r['mesh']} batch {r['batch']}: run.py {r['run.py_steps_per_sec']:.0f} steps/s = "
              f"{r['run_py_over_device']:.2f}x device-resident ({r['device_steps_per_sec']:.0f}); old "
              f"{r['old_over_device']:.2f}x" for r in rows if r.get("part") == "steps"]
    return ["; ".join(lines)]


if __name__ == "__main__":
    main()
