"""Bytes of the text corpus each process reads: 1 process against 2, the corpus on disk against the corpus in memory.

    python -m benchmarks.data_reads                          # run.py's defaults: 300 steps of batch 32, seq_len 128
    python -m benchmarks.data_reads --steps 100 --processes 1,2,4 --data PATH

For each process count N, N processes x 1 CPU device (`jaxpar.launch`, a data axis of N) each draw what `run.py`
draws with the same flags: its rows (`BatchPlacer.local_rows`, as `Trainer.local_rows`) of --steps global training
batches, then its rows of the final evaluation's --eval-batches held-out batches. Each process measures two ways of
getting them, read by the kernel's count of bytes this process read (/proc/self/io `rchar`, taken around that code
only):
- `on disk` (what run.py does): `open_corpus` + `split_corpus`, windows read as their batches are drawn; also the
  corpus's own count of bytes read (`Corpus.bytes_read`);
- `in memory` (what run.py did before): `load_text` (the whole corpus, up to 4 MiB) + `split_text`.
Then, in this one process, the host time to draw one global batch of training windows each way (rounds alternating
in memory / on disk, --rounds rounds of --steps batches, the median per batch): what reading on demand adds to a
step. Prints markdown tables and one JSON line per process and one for the timing. No device work: only host data
loading.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rchar() -> int:
    """Bytes this process has read through read-like system calls (/proc/self/io; page-cache hits included)."""
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("rchar:")).split()[1])


def worker(args) -> None:
    sys.path.insert(0, ROOT)
    import jaxpar

    jaxpar.runtime.distributed.initialize()
    import jax

    from jaxpar.cli.config import Config
    from jaxpar.io import data
    from jaxpar.train.batches import BatchPlacer

    config = Config(data=args.data).resolved()
    rows = BatchPlacer(jaxpar.make_mesh(f"data={jax.process_count()}")).local_rows
    batch, seq_len = config.batch_size, config.seq_len

    def draw(train, held_out):
        batches = data.Batches(data.TextWindows(train, seq_len), batch, config.seed, rows=rows)
        for _ in range(args.steps):
            next(batches)
        windows = data.TextWindows(held_out, seq_len)
        held = data.Batches(windows, batch, seed=0, shuffle=False, rows=rows)
        for _ in range(min(config.eval_batches, len(windows) // batch)):  # as jaxpar/cli/training.py's evaluate
            next(held)

    before = rchar()
    corpus = data.open_corpus(config.data)
    draw(*data.split_corpus(corpus, seq_len=seq_len))
    on_disk = rchar() - before
    before = rchar()
    draw(*data.split_text(data.load_text(config.data), seq_len=seq_len))
    in_memory = rchar() - before
    row = {"processes": jax.process_count(), "rank": jax.process_index(), "steps": args.steps, "batch_size": batch,
           "seq_len": seq_len, "corpus_bytes": len(corpus), "corpus_bytes_read": corpus.bytes_read,
           "on_disk_rchar": on_disk, "in_memory_rchar": in_memory}
    with open(os.path.join(args.worker, f"{jax.process_count()}-{jax.process_index()}.json"), "w") as out:
        json.dump(row, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training batches drawn (run.py --steps)")
    parser.add_argument("--processes", default="1,2", help="process counts to compare, comma-separated")
    parser.add_argument("--data", default=None, help="run.py --data (default: the standard library corpus)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of the draw-time measurement")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a launched process: its output folder
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for count in map(int, args.processes.split(",")):
            command = [sys.executable, "-m", "jaxpar.runtime.launch", "--nproc", str(count), "--devices-per-process",
                       "1", "--", os.path.abspath(__file__), "--steps", str(args.steps), "--worker", folder]
            if args.data:
                command += ["--data", args.data]
            subprocess.run(command, cwd=ROOT, check=True, timeout=300, stdout=subprocess.DEVNULL)
            rows += [json.load(open(os.path.join(folder, f"{count}-{rank}.json"))) for rank in range(count)]
    print(f"Bytes read per process, {args.steps} steps of batch {rows[0]['batch_size']} x {rows[0]['seq_len'] + 1} "
          f"bytes + the final evaluation; corpus {rows[0]['corpus_bytes']:,} bytes\n")
    print("| processes | rank | on disk: rchar | on disk: Corpus.bytes_read | in memory (before): rchar | "
          "in memory / on disk |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['processes']} | {r['rank']} | {r['on_disk_rchar']:,} | {r['corpus_bytes_read']:,} | "
              f"{r['in_memory_rchar']:,} | {r['in_memory_rchar'] / r['on_disk_rchar']:.1f} |")
    print()
    timing = draw_time(args)
    print(f"Host time to draw one global batch ({timing['batch_size']} windows of {timing['seq_len'] + 1} bytes), "
          f"median of {args.rounds} alternating rounds of {args.steps} batches\n")
    print("| corpus in memory (before) | on disk (now) | on disk / in memory |\n|---|---|---|")
    print(f"| {timing['in_memory_us']:.0f} us | {timing['on_disk_us']:.0f} us | "
          f"{timing['on_disk_us'] / timing['in_memory_us']:.2f} |\n")
    for r in rows + [timing]:
        print(json.dumps(r))


def draw_time(args) -> dict:
    import statistics
    import time

    sys.path.insert(0, ROOT)
    from jaxpar.cli.config import Config
    from jaxpar.io import data

    config = Config(data=args.data).resolved()
    parts = {"in_memory": data.split_text(data.load_text(config.data), seq_len=config.seq_len)[0],
             "on_disk": data.split_corpus(data.open_corpus(config.data), seq_len=config.seq_len)[0]}
    times = {name: [] for name in parts}
    for round_ in range(args.rounds):
        for name, part in parts.items():
            batches = data.text_batches(part, config.batch_size, config.seq_len, seed=round_)
            start = time.perf_counter()
            for _ in range(args.steps):
                next(batches)
            times[name].append((time.perf_counter() - start) / args.steps * 1e6)
    return {"kind": "draw_time", "batch_size": config.batch_size, "seq_len": config.seq_len, "rounds": args.rounds,
            **{f"{name}_us": statistics.median(t) for name, t in times.items()}}


def summarize(rows):
    """The suite's summary cell (`python -m benchmarks`) from this script's JSON rows."""
    cells = [f"{r['processes']} proc. rank {r['rank']}: {r['on_disk_rchar']:,} B (in memory {r['in_memory_rchar']:,})"
             for r in rows if "processes" in r]
    lines = ["corpus bytes read per process, on disk (before: in memory): " + "; ".join(cells)]
    for r in (r for r in rows if r.get("kind") == "draw_time"):
        lines.append(f"drawing a batch: on disk {r['on_disk_us']:.0f} us, in memory {r['in_memory_us']:.0f} us")
    return lines


if __name__ == "__main__":
    main()
