"""Context parallelism (the seq axis) with the built-in transformer: memory per device against seq, the causal
balance of the ring with and without zig-zag, the bytes over seq against theory, and steps/s of seq=S against data=S
at the same global token count.

    python -m benchmarks.context                                  # every part
    python -m benchmarks.context --parts memory --seq-len 4096

- memory: the compiled step's temporaries per device (XLA memory analysis; nothing runs) of the default transformer
  (2 layers, d_model 128, 4 heads, d_ff 512) at --seq-len on seq=1, 2, 4, 8 with the same rows per seq group
  (--rows), for --memory-algorithms; the ratio to seq=1;
- balance: per-device query-key pairs of the causal ring, contiguous and zig-zag (`zigzag.work`), in (L/S)^2;
- traffic: `jaxpar.explain`'s bytes over seq against theory, each algorithm on seq=4;
- speed: steps/s of seq=S (--speed-mesh) against data=S on the same model and global batch (the same tokens),
  alternating rounds.

Every row is also printed as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import jaxpar
from jaxpar.cli import Config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="balance,traffic,memory,speed")
    parser.add_argument("--seq-len", type=int, default=4096, help="memory: the sequence length")
    parser.add_argument("--rows", type=int, default=1, help="memory: rows (examples) per seq group")
    parser.add_argument("--memory-ways", default="1,2,4,8")
    parser.add_argument("--memory-algorithms", default="allgather,ring")
    parser.add_argument("--speed-mesh", default="seq=4")
    parser.add_argument("--speed-seq-len", type=int, default=256)
    parser.add_argument("--speed-batch", type=int, default=8)
    parser.add_argument("--algorithm", default="allgather", help="speed: the seq mesh's algorithm")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    jaxpar.make_mesh("8")  # before anything touches JAX: the 8 CPU devices
    parts = args.parts.split(",")
    if "balance" in parts:
        balance()
    if "traffic" in parts:
        traffic()
    if "memory" in parts:
        memory(args.seq_len, args.rows, [int(w) for w in args.memory_ways.split(",")],
               args.memory_algorithms.split(","))
    if "speed" in parts:
        speed(args.speed_mesh, args.speed_seq_len, args.speed_batch, args.algorithm, args.rounds, args.steps)


def _emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def trainer(mesh: str, seq_len: int, algorithm: str = "allgather", dropout: float = 0.0, **model):
    import optax

    import models

    config = Config(model="transformer", seq_len=seq_len, dropout=dropout, **model).resolved()
    return jaxpar.Trainer(model=models.factory(config), loss_fn=models.LOSSES["transformer"],
                          optimizer=optax.adamw(1e-3), mesh=jaxpar.make_mesh(mesh), context_parallel=algorithm)


def _batch(rows: int, seq_len: int):
    import numpy as np

    return {"tokens": np.random.default_rng(0).integers(0, 256, (rows, seq_len + 1)).astype(np.int32)}


def balance() -> None:
    from jaxpar.parallel.context import zigzag

    print("\n| S | contiguous work per device | imbalance | zig-zag work per device | imbalance |\n|---|---|---|---|---|")
    for ways in (2, 4, 8):
        flat, zz = zigzag.work(ways, zigzag=False), zigzag.work(ways, zigzag=True)
        row = {"part": "balance", "ways": ways, "contiguous": flat, "contiguous_imbalance": zigzag.imbalance(ways, zigzag=False),
               "zigzag": zz, "zigzag_imbalance": zigzag.imbalance(ways, zigzag=True)}
        print(f"| {ways} | {flat} | {row['contiguous_imbalance']:.3f} | {zz} | {row['zigzag_imbalance']:.3f} |")
        _emit(row)


def traffic() -> None:
    print("\n| algorithm | mesh | bytes over seq per device per step | theory | measured / theory |\n|---|---|---|---|---|")
    for algorithm in ("allgather", "ring", "ulysses"):
        t = trainer("seq=4", 64, algorithm, layers=2, d_model=32, heads=4, d_ff=64)
        c = jaxpar.explain(t, _batch(4, 64))["variants"]["sync"]["context"]
        ratio = c["bytes"] / c["theory"]
        print(f"| {algorithm} | seq=4 | {c['bytes']:,.0f} | {c['theory']:,.0f} | {ratio:.4f} |")
        _emit({"part": "traffic", "algorithm": algorithm, "bytes": c["bytes"], "theory": c["theory"], "ratio": ratio})


def memory(seq_len: int, rows: int, ways_list: list[int], algorithms: list[str]) -> None:
    print(f"\n| algorithm | seq | temporaries per device (bytes) | / seq=1 |\n|---|---|---|---|")
    base = {}
    for algorithm in algorithms:
        for ways in ways_list:
            t = trainer(f"seq={ways}" if ways > 1 else "1", seq_len, algorithm)
            temp = t.compiled_step("sync", _batch(rows, seq_len)).memory_analysis().temp_size_in_bytes
            base.setdefault(algorithm, temp)
            ratio = temp / base[algorithm]
            print(f"| {algorithm} | {ways} | {temp:,} | {ratio:.3f} |", flush=True)
            _emit({"part": "memory", "algorithm": algorithm, "ways": ways, "seq_len": seq_len, "rows": rows,
                   "temp_bytes": temp, "ratio": ratio})


def speed(mesh: str, seq_len: int, batch: int, algorithm: str, rounds: int, steps: int) -> None:
    import jax

    ways = jaxpar.make_mesh(mesh).size
    runs = {mesh: trainer(mesh, seq_len, algorithm), f"data={ways}": trainer(f"data={ways}", seq_len)}
    states = {name: t.init(0) for name, t in runs.items()}
    data = _batch(batch, seq_len)
    for name, t in runs.items():  # compile
        states[name], m = t.step(states[name], data)
        jax.block_until_ready(m["loss"])
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, t in runs.items():
            start = time.perf_counter()
            for _ in range(steps):
                states[name], m = t.step(states[name], data)
                jax.block_until_ready(m["loss"])
            times[name].append(steps / (time.perf_counter() - start))
    print(f"\n| mesh | steps/s (best of {rounds} rounds of {steps}) | tokens per step |\n|---|---|---|")
    for name in runs:
        print(f"| {name}{' (' + algorithm + ')' if name == mesh else ''} | {max(times[name]):.3f} | {batch * seq_len:,} |")
        _emit({"part": "speed", "mesh": name, "steps_per_s": max(times[name]), "tokens": batch * seq_len})
    ratio = max(times[mesh]) / max(times[f"data={ways}"])
    print(f"\n{mesh} / data={ways} steps/s: {ratio:.3f}")
    _emit({"part": "speed_ratio", "ratio": ratio})


def summarize(rows):
    """The suite's summary cell (`python -m benchmarks`) from this script's JSON rows."""
    lines = []
    mem = [r for r in rows if r.get("part") == "memory"]
    if mem:
        last = mem[-1]
        lines.append(f"memory: seq={last['ways']} temporaries **{last['ratio']:.3f}x** seq=1 ({last['algorithm']})")
    speed = [r for r in rows if r.get("part") == "speed_ratio"]
    if speed:
        lines.append(f"speed: seq / data steps/s **{speed[0]['ratio']:.3f}**")
    return lines


if __name__ == "__main__":
    main()
