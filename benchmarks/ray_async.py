"""Wall-clock asynchrony on the Ray runtime: ASP, SSP(2) and BSP (sync through the server) with one slow worker of
four, side by side in one Ray instance, against the emulator's projection for the same straggler profile; and the
server's overhead per version (push + apply + pull against a worker's compute) with 2 workers, with one server and
with two server shards. Each run's schedule
is replayed through the emulation (its parameters exactly) to evaluate a held-out set every 10 versions: the time to
a held-out loss.

    python -m benchmarks.ray_async                      # 400 server updates per run
    python -m benchmarks.ray_async --steps 100          # quicker
    python -m benchmarks.ray_async --batch 2048 --steps 200   # compute well above Ray's round trip

The model is a wide MLP on synthetic regression data (numpy, seeded per (worker, batch)). At the default global
batch of 256 a step's compute (about 8 ms) is below Ray's round trip (about 12 ms); `--batch 2048` puts it well
above. One JSON line per run and one for the ratios. Numbers under a
shared machine's load are noisy: compare the ratios of one invocation.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.runtime.ray.schedule import replay_batches, replay_strategy
from jaxpar.strategies.simulation import simulate_ps, simulate_server
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


def batches(worker, workers, seq, batch=BATCH):
    rng = np.random.default_rng([worker, seq])
    x = rng.standard_normal((batch // workers, 64)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, :8].sum(1)).astype(np.float32)}


HELD_OUT = 4096  # rows of the held-out set, drawn from its own seed


def held_out():
    rng = np.random.default_rng(10_000)
    x = rng.standard_normal((HELD_OUT, 64)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, :8].sum(1)).astype(np.float32)}


def held_out_curve(schedule, workers: int, batch_fn, every: int = 10) -> list[tuple[int, float]]:
    """(version, held-out loss) every `every` versions of a run, from its schedule replayed through the emulation
    (which gives the runtime's parameters exactly: tests/runtime/test_ray_runtime.py)."""
    trainer = jaxpar.Trainer(Wide, loss, optax.sgd(0.01), jaxpar.make_mesh(f"data={workers}",
                             devices=jax.devices()[:workers]), strategy=replay_strategy(schedule, workers))
    state, evaluation, curve = trainer.init(0), held_out(), []
    for version, batch in enumerate(replay_batches(schedule, batch_fn, workers), 1):
        state, _ = trainer.step(state, batch)
        if version % every == 0 or version == len(schedule):
            curve.append((version, float(trainer.evaluate(state, evaluation)["loss"])))
    return curve


def time_to_held_out(curve, records, target: float) -> float | None:
    """Wall seconds (the server's record of that version) at which the held-out loss first reaches `target`."""
    for version, value in curve:
        if value <= target:
            return records[version - 1]["wall"] - records[0]["wall"]
    return None


def time_to(records, target: float, window: int = 20) -> float | None:
    """Wall seconds until the mean training loss of the last `window` updates first reaches `target`."""
    losses = [r["loss"] for r in records]
    for i in range(window, len(losses) + 1):
        if statistics.fmean(losses[i - window:i]) <= target:
            return records[i - 1]["wall"]
    return None


def one(strategy, mesh, steps, label, batch_fn, shards=1):
    from jaxpar.runtime.ray import run

    started = time.time()
    out = run(Wide, loss, optax.sgd(0.01), mesh, strategy, batch_fn, steps, server_shards=shards)
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
    return row, {"records": out.records, "schedule": out.schedule}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--stragglers", default="1:3.0")
    parser.add_argument("--batch", type=int, default=BATCH, help="global batch (rows over all workers): a larger one "
                        "makes each step's compute larger against Ray's round trip")
    args = parser.parse_args(argv)
    batch_fn = functools.partial(batches, batch=args.batch)
    jaxpar.make_mesh("data=4")  # before anything touches JAX: the driver's CPU devices, for the held-out replay
    import ray

    from jaxpar.runtime.ray.connect import start

    start(num_cpus=2)  # the runtime's quiet local instance, shared by every run below
    try:
        s = args.stragglers
        rows = {}
        for label, strategy in (("sync", jaxpar.Sync(stragglers=s)), ("asp", jaxpar.ASP(stragglers=s)),
                                ("ssp2", jaxpar.SSP(2, stragglers=s))):
            rows[label] = one(strategy, "data=4", args.steps, label, batch_fn)
        overhead, overhead_run = one(jaxpar.ASP(), "data=2", args.steps, "overhead-asp-2-workers", batch_fn)
        sharded, _ = one(jaxpar.ASP(), "data=2", args.steps, "overhead-asp-2-workers-2-server-shards", batch_fn,
                         shards=2)
    finally:
        ray.shutdown()
    curves = {k: held_out_curve(v[1]["schedule"], 4, batch_fn) for k, v in rows.items()}
    held_target = max(curves["sync"][-1][1], curves["asp"][-1][1]) * 1.05
    held_reach = {k: time_to_held_out(curves[k], v[1]["records"], held_target) for k, v in rows.items()}
    target = max(rows["sync"][0]["final_loss"], rows["asp"][0]["final_loss"]) * 1.05
    stragglers = parse_stragglers(s)
    jittered = parse_stragglers(s + ",jitter=0.1")
    emulated = {name: {bound_name: simulate_ps(profile, 4, bound, args.steps)[-1].sim_time
                       for bound_name, bound in (("asp", None), ("ssp2", 2), ("sync", 0))}
                for name, profile in (("exact", stragglers), ("jitter0.1", jittered))}
    # the runtime's own terms: each push its own arrival; unit compute (the emulator's projection), then the
    # 2-worker run's median compute and push round trip (a calibration independent of the runs compared)
    # the server's own time per update (its records' apply_s) is served one at a time; the rest of a push's wait
    # is the round trip
    compute = overhead["median_compute_s"]
    service = statistics.median(r["apply_s"] for r in overhead_run["records"])
    trip = max(overhead["median_wait_s"] - service, 0.0)
    prices = (("unit", (1.0, 0.0, 0.0)), ("calibrated", (compute, overhead["median_wait_s"], 0.0)),
              ("served", (compute, trip, service)))
    server = {bound_name: {how: simulate_server(stragglers, 4, bound, args.steps, *price)[-1].sim_time
                           for how, price in prices}
              for bound_name, bound in (("asp", None), ("ssp2", 2), ("sync", 0))}
    wall = {k: v[0]["wall_s"] for k, v in rows.items()}
    reach = {k: time_to(v[1]["records"], target) for k, v in rows.items()}
    summary = {"stragglers": s, "steps": args.steps, "batch": args.batch, "asp_over_sync_wall": wall["asp"] / wall["sync"],
               "ssp2_over_sync_wall": wall["ssp2"] / wall["sync"],
               "emulated_asp_over_sync": emulated["exact"]["asp"] / emulated["exact"]["sync"],
               "emulated_asp_over_sync_jitter0.1": emulated["jitter0.1"]["asp"] / emulated["jitter0.1"]["sync"],
               "emulated_ssp2_over_sync": emulated["exact"]["ssp2"] / emulated["exact"]["sync"],
               "server_asp_over_sync": server["asp"]["unit"] / server["sync"]["unit"],
               "server_ssp2_over_sync": server["ssp2"]["unit"] / server["sync"]["unit"],
               "server_calibrated_asp_over_sync": server["asp"]["calibrated"] / server["sync"]["calibrated"],
               "server_calibrated_ssp2_over_sync": server["ssp2"]["calibrated"] / server["sync"]["calibrated"],
               "server_calibrated_sync_s": server["sync"]["calibrated"],
               "server_served_asp_over_sync": server["asp"]["served"] / server["sync"]["served"],
               "server_served_ssp2_over_sync": server["ssp2"]["served"] / server["sync"]["served"],
               "server_service_s": service,
               "ssp2_staleness_max": rows["ssp2"][0]["staleness_max"], "target_train_loss": target,
               "target_held_out_loss": held_target, "time_to_held_out_target_s": held_reach,
               "asp_over_sync_time_to_held_out": (held_reach["asp"] / held_reach["sync"])
               if held_reach["asp"] and held_reach["sync"] else None,
               "ssp2_over_sync_time_to_held_out": (held_reach["ssp2"] / held_reach["sync"])
               if held_reach["ssp2"] and held_reach["sync"] else None,
               "final_held_out": {k: c[-1][1] for k, c in curves.items()},
               "time_to_target_s": reach,
               "asp_over_sync_time_to_target": (reach["asp"] / reach["sync"]) if reach["asp"] and reach["sync"]
               else None,
               "overhead_median_wait_s": overhead["median_wait_s"],
               "overhead_median_compute_s": overhead["median_compute_s"],
               "two_shards_median_wait_s": sharded["median_wait_s"],
               "two_shards_median_compute_s": sharded["median_compute_s"]}
    print(json.dumps(summary), flush=True)


def summarize(rows):
    r = rows[-1]
    return [f"asp / sync wall **{r['asp_over_sync_wall']:.3f}** (emulator on the server's terms "
            f"{r['server_asp_over_sync']:.3f}, calibrated {r['server_calibrated_asp_over_sync']:.3f}); "
            f"ssp2 / sync {r['ssp2_over_sync_wall']:.3f}; server round trip {r['overhead_median_wait_s'] * 1e3:.1f} "
            f"ms per push against {r['overhead_median_compute_s'] * 1e3:.1f} ms compute"]


if __name__ == "__main__":
    main()
