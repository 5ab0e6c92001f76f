"""How long the plan advisor takes (`jaxpar.plan`, what `run.py --plan` runs): compiling the meshes one at a time
against `workers` at a time, in alternating rounds, with the persistent compilation cache off (every compile is a
real one, as on a first run).

    python -m benchmarks.plan_speed                      # the default transformer, 8 devices, 1 vs 2 workers
    python -m benchmarks.plan_speed --model mlp --rounds 1

Each round runs the whole advisor once per setting (10 meshes for 8 devices, every one compiled once, and the
remat policies on the first mesh); the printed seconds are the median round of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jaxpar
from benchmarks import common


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--hardware", default="a100-eth10")
    parser.add_argument("--workers", default="1,2", help="settings compared, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    jaxpar.make_mesh(str(args.devices))  # before anything touches JAX: the CPU devices
    import jax
    import optax

    from jaxpar.advisor import advise
    from jaxpar.runtime.compile_cache import use_compile_cache

    use_compile_cache(None)
    parts = common.setup(args.model)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in parts.batch.items()}
    settings = [int(w) for w in args.workers.split(",")]
    seconds = {w: [] for w in settings}
    results = {}
    for _ in range(args.rounds):
        for workers in settings:
            jax.clear_caches()  # nothing compiled in an earlier round is reused
            started = time.perf_counter()
            results[workers] = advise(parts.factory, parts.loss_fn, optax.adamw(1e-3), batch, args.hardware,
                                      args.devices, workers=workers)
            seconds[workers].append(time.perf_counter() - started)
            print(f"workers={workers}: {seconds[workers][-1]:.1f} s", flush=True)
    same = len({tuple((c.flags, round(c.seconds, 12), c.memory) for c in r["plans"]) for r in results.values()}) == 1
    row = {"model": args.model, "devices": args.devices, "plans": len(results[settings[0]]["plans"]),
           "refused": len(results[settings[0]]["refused"]), "same_plans": same,
           "median_seconds": {str(w): statistics.median(s) for w, s in seconds.items()}}
    print(" | ".join(f"workers={w}: median {statistics.median(s):.1f} s" for w, s in seconds.items()) +
          f" | identical plans: {same}")
    print(json.dumps(row))


def summarize(rows):
    r = rows[-1]
    return [f"jaxpar.plan on {r['devices']} devices ({r['model']}): " +
            ", ".join(f"{w} worker(s) {s:.1f} s" for w, s in r["median_seconds"].items())]


if __name__ == "__main__":
    main()
