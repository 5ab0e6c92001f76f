"""Wall-clock asynchrony on the Ray runtime: ASP, SSP(2) and BSP (sync through the server) with one slow worker of
four, side by side in one Ray instance, against the emulator's projection for the same straggler profile; and the
server's overhead per version (push + apply + pull against a worker's compute) with 2 workers.

    python -m benchmarks.ray_async                      # 400 server updates per run
    python -m benchmarks.ray_async --steps 100          # quicker

The model is a wide MLP on synthetic regression data (numpy, seeded per (worker, batch)), sized so that a step's
compute (tens of ms) is well above Ray's round trip. One JSON line per run and one for the ratios. Numbers under a
shared machine's load are noisy: compare the ratios of one invocation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.strategies.simulation import simulate_ps
from jaxpar.strategies.stragglers import parse_stragglers

WIDTH, BATCH = 512, 256


class Wide(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(64, WIDTH, rngs=rngs)
        self.b = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.c = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, x):
        return self.c(jax.nn.relu(self.b(jax.nn.relu(self.a(x)))))


def loss(model, batch):
    return ((model(batch["x"])[:, 0] - batch["y"]) ** 2).mean(), {}


def batches(worker, workers, seq):
    rng = np.random.default_rng([worker, seq])
    x = rng.standard_normal((BATCH // workers, 64)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, :8].sum(1)).astype(np.float32)}


def time_to(records, target: float, window: int = 20) -> float | None:
    """Wall seconds until the mean training loss of the last `window` updates first reaches `target`."""
    losses = [r["loss"] for r in records]
    for i in range(window, len(losses) + 1):
        if statistics.fmean(losses[i - window:i]) <= target:
            return records[i - 1]["wall"]
    return None


def one(strategy, mesh, steps, label):
    from jaxpar.runtime.ray import run

    started = time.time()
    out = run(Wide, loss, optax.sgd(0.01), mesh, strategy, batches, steps)
    waits, computes = [], []
    import glob
    import os

    for path in glob.glob(os.path.join(out.run_dir, "worker-*.jsonl")):
        for line in open(path):
            record = json.loads(line)
            waits.append(record["wait_s"])
            computes.append(record["compute_s"])
    row = {"run": label, "mesh": mesh, "steps": out.version, "wall_s": out.seconds, "total_s": time.time() - started,
           "final_loss": statistics.fmean(r["loss"] for r in out.records[-20:]),
           "staleness_max": max(r["staleness_max"] for r in out.records),
           "median_compute_s": statistics.median(computes), "median_wait_s": statistics.median(waits)}
    print(json.dumps(row), flush=True)
    return row, out.records


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--stragglers", default="1:3.0")
    args = parser.parse_args(argv)
    import ray

    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False, logging_level="ERROR")
    try:
        s = args.stragglers
        rows = {}
        for label, strategy in (("sync", jaxpar.Sync(stragglers=s)), ("asp", jaxpar.ASP(stragglers=s)),
                                ("ssp2", jaxpar.SSP(2, stragglers=s))):
            rows[label] = one(strategy, "data=4", args.steps, label)
        overhead, _ = one(jaxpar.ASP(), "data=2", args.steps, "overhead-asp-2-workers")
    finally:
        ray.shutdown()
    target = max(rows["sync"][0]["final_loss"], rows["asp"][0]["final_loss"]) * 1.05
    stragglers = parse_stragglers(s)
    jittered = parse_stragglers(s + ",jitter=0.1")
    emulated = {name: {bound_name: simulate_ps(profile, 4, bound, args.steps)[-1].sim_time
                       for bound_name, bound in (("asp", None), ("ssp2", 2), ("sync", 0))}
                for name, profile in (("exact", stragglers), ("jitter0.1", jittered))}
    wall = {k: v[0]["wall_s"] for k, v in rows.items()}
    reach = {k: time_to(v[1], target) for k, v in rows.items()}
    summary = {"stragglers": s, "steps": args.steps, "asp_over_sync_wall": wall["asp"] / wall["sync"],
               "ssp2_over_sync_wall": wall["ssp2"] / wall["sync"],
               "emulated_asp_over_sync": emulated["exact"]["asp"] / emulated["exact"]["sync"],
               "emulated_asp_over_sync_jitter0.1": emulated["jitter0.1"]["asp"] / emulated["jitter0.1"]["sync"],
               "emulated_ssp2_over_sync": emulated["exact"]["ssp2"] / emulated["exact"]["sync"],
               "ssp2_staleness_max": rows["ssp2"][0]["staleness_max"], "target_train_loss": target,
               "time_to_target_s": reach,
               "asp_over_sync_time_to_target": (reach["asp"] / reach["sync"]) if reach["asp"] and reach["sync"]
               else None,
               "overhead_median_wait_s": overhead["median_wait_s"],
               "overhead_median_compute_s": overhead["median_compute_s"]}
    print(json.dumps(summary), flush=True)


def summarize(rows):
    r = rows[-1]
    return [f"asp / sync wall **{r['asp_over_sync_wall']:.3f}** (emulator {r['emulated_asp_over_sync']:.3f}); "
            f"ssp2 / sync {r['ssp2_over_sync_wall']:.3f}; server round trip {r['overhead_median_wait_s'] * 1e3:.1f} "
            f"ms per push against {r['overhead_median_compute_s'] * 1e3:.1f} ms compute"]


if __name__ == "__main__":
    main()
