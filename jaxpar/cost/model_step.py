"""A model's own training step on the machine at hand: its fixed cost per step and its utilisation of the
calibrated matmul rate, from timed reference runs (`python -m jaxpar.calibrate --model NAME`).

Why. A matmul loop's FLOP/s and an empty program's launch time do not price a training step on XLA:CPU's emulated
devices: measured on this machine, the MLP's step is mostly a fixed cost per step (dispatch, the many small ops of
the optimizer and the guard, each a thunk on every device) and a transformer's step sustains a fraction of the
matmul rate (docs/cost-model.md, validated on this machine). Both depend on the model, so the model is measured.

What is timed: sync SGD with the compiler's all-reduce on one mesh (the reference; default every device on data),
at global batches B, 2B, 4B, 8B and 16B (`BATCH_FACTORS`): the FLOPs per device change, the gradient exchange does not.
Each is warmed up, then `ROUNDS` rounds of `STEPS` steps, alternating them, run with at most two in flight (as
`fit` runs them); the fastest round gives seconds per step (the load of other work is noise, as in the links'
calibration).

The fit. With P the projected compute (FLOPs per device / the matmul rate) and C the projected communication of
the compiled step (priced on the calibrated links), a step is taken to cost

    t = fixed + P / u + C

and 1/u is the slope of the least-squares line of t - C against P over the batches, fixed its mean rest
(mean of t - C - P / u); the fit's relative RMS and worst residual are reported. With two batches that is
1/u = ((t2 - C2) - (t1 - C1)) / (P2 - P1): a noisy pair swung u from 0.43 to 1.0. 1/u below 1 (a step
faster than the matmul loop) or not a number is noise: u = 1 then, and fixed = the mean of t - C - P. A negative
fixed is taken as 0 (said in the note). The profile then prices compute at u x the matmul rate (`sustained`) and
the fixed cost as every step's `launch`, and names the model (`model`): it projects that model, not another.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

# the reference's global batches, in multiples of B: a least-squares line through five sizes over a 16x range, not
# two points 4x apart (two calibrations in a row with (1, 4) gave the MLP utilisation 0.425 and 1.0 on this machine:
# its compute at batch 4B is below the noise of its fixed cost; docs/cost-model.md)
BATCH_FACTORS = (1, 2, 4, 8, 16)
STEPS, ROUNDS, WARMUP = 20, 5, 3


def fit_step(points) -> dict:
    """`points`: [(P, C, t)] at two or more batches (projected compute, projected communication, measured seconds
    per step). Returns {"utilisation": u, "fixed": seconds, "note": ..., "rms_relative_error",
    "worst_relative_error"} (the module docstring's fit: the least-squares line of t - C against P; the errors are
    the fitted step times' against the measured, before a negative fixed cost is taken as 0)."""
    import numpy as np

    p = np.array([x[0] for x in points], float)
    rest = np.array([x[2] - x[1] for x in points], float)
    note = ""
    slope = float(np.polyfit(p, rest, 1)[0]) if len(points) > 1 and np.ptp(p) > 0 else float("nan")
    if not slope >= 1.0:  # also nan: the time does not grow with the FLOPs beyond the noise
        inverse = 1.0
        fixed = float(np.mean(rest - p))
        note = (f"the step's time did not grow with its FLOPs as the matmul loop's does (slope {slope:.3g}): "
                f"utilisation taken as 1, the rest is fixed cost")
    else:
        inverse = slope
        fixed = float(np.mean(rest - p * inverse))
    measured = np.array([x[2] for x in points], float)
    relative = (fixed + p * inverse + (measured - rest) - measured) / measured
    errors = {"rms_relative_error": float(np.sqrt(np.mean(relative ** 2))),
              "worst_relative_error": float(np.max(np.abs(relative)))}
    if fixed < 0:
        note = (note + "; " if note else "") + f"fixed cost came out {fixed * 1e6:.1f} us: taken as 0"
        fixed = 0.0
    return {"utilisation": 1.0 / inverse, "fixed": fixed, "note": note, **errors}


def runner(trainer, batch) -> Callable[[int], None]:
    """`run(n)`: n training steps of `trainer` on `batch` from a fresh state, at most two in flight as `fit` runs
    them (nothing read back; the wait for step N-1 before step N+1 is dispatched), ending when the last is done."""
    import jax

    state = trainer.init(0)
    placed = trainer.shard_batch(batch)

    def run(n: int) -> None:
        nonlocal state
        previous = None
        for _ in range(n):
            state, metrics, _ = trainer.dispatch(state, placed)
            if previous is not None:
                jax.block_until_ready(previous)
            previous = metrics["loss"]
        jax.block_until_ready(previous)

    return run


def alternating_seconds(runs: list, steps: int, rounds: int, warmup: int = WARMUP,
                        statistic: Callable = statistics.median) -> list[float]:
    """Seconds per step of each `runner` in `runs`: `warmup` steps each, then `rounds` rounds of `steps` steps that
    alternate the runners (so the machine's noise hits them alike); the `statistic` (median) round of each."""
    for run in runs:
        run(warmup)
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for i, run in enumerate(runs):
            started = time.perf_counter()
            run(steps)
            times[i].append((time.perf_counter() - started) / steps)
    return [statistic(t) for t in times]


def time_steps(trainer, batch, steps: int = STEPS, rounds: int = ROUNDS, warmup: int = WARMUP) -> float:
    """Median over `rounds` of the seconds per step of `steps` steps (`runner`)."""
    return alternating_seconds([runner(trainer, batch)], steps, rounds, warmup)[0]


def projected_parts(trainer, batch, launch: float) -> tuple[float, float]:
    """(P, C): the projected compute without the launch and the exposed communication of the trainer's first step
    variant on global batches shaped like `batch`, on the trainer's profile."""
    from jaxpar.cost.hardware import compiled_cost
    from jaxpar.cost.step_pricer import profile_of

    variant = trainer.strategy.plan(trainer.ctx, 0).variant
    cost = compiled_cost(trainer.compiled_step(variant, batch), trainer.mesh, profile_of(trainer))
    return cost.compute - launch, cost.exposed


def measure(make_trainer: Callable, batch_of: Callable[[int], dict], batch_size: int, profile,
            factors=BATCH_FACTORS, timer: Callable | None = None, progress=None, steps: int = STEPS,
            rounds: int = ROUNDS) -> dict:
    """Times the reference (`make_trainer(profile)`: a sync Trainer on the reference mesh priced on `profile`) at
    global batches `batch_of(f x batch_size)` and fits it. `timer(trainer, batch) -> seconds` replaces the
    measurement (tests). Returns {"points": [{batch, compute, communication, measured}], "utilisation", "fixed",
    "note"}."""
    runs, points = [], []
    for factor in factors:
        batch = batch_of(factor * batch_size)
        trainer = make_trainer(profile)
        compute, comm = projected_parts(trainer, batch, profile.launch)
        runs.append((trainer, batch))
        points.append({"batch": factor * batch_size, "compute": compute, "communication": comm})
    # the fastest round, as the links' calibration keeps the fastest call: other sessions' load is noise, never the
    # step's own cost (two calibrations in a row with the median: fixed cost 1,892 and 1,114 us; docs/cost-model.md)
    measured = ([timer(trainer, batch) for trainer, batch in runs] if timer else
                alternating_seconds([runner(trainer, batch) for trainer, batch in runs], steps, rounds,
                                    statistic=min))
    for point, seconds in zip(points, measured):
        point["measured"] = seconds
        if progress:
            progress(f"reference step at batch {point['batch']}: {seconds * 1e3:,.3f} ms measured (projected compute "
                     f"{point['compute'] * 1e3:,.3f} ms at the matmul rate, communication "
                     f"{point['communication'] * 1e3:,.3f} ms)")
    fitted = fit_step([(x["compute"], x["communication"], x["measured"]) for x in points])
    return {"points": points, **fitted}


def apply(profile: dict, model: str, mesh: str, result: dict) -> dict:
    """The calibrated profile dict `profile` (`jaxpar.cost.calibration.calibrate`'s) with `model`'s step measured
    on `mesh`: sustained = utilisation x the matmul rate, launch = the fixed cost, the model named, the reference
    kept under calibration.model."""
    from jaxpar.cost.profile_json import MEASUREMENTS

    out = dict(profile)
    out["sustained"] = float(profile["flops"] * result["utilisation"])
    out["launch"] = float(result["fixed"])
    out["model"] = model
    out["name"] = f"calibrated-{model}"
    out["source"] = (profile["source"] + f"; {model}'s training step (sync, mesh {mesh}, batches "
                     f"{', '.join(str(x['batch']) for x in result['points'])}): utilisation "
                     f"{result['utilisation']:.3g} of the matmul rate, fixed cost {result['fixed'] * 1e6:,.1f} us "
                     f"per step (sustained and launch)")
    out[MEASUREMENTS] = dict(profile.get(MEASUREMENTS, {}), model={"name": model, "mesh": mesh, **result})
    return out
