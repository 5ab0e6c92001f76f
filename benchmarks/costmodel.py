"""The cost model against this machine: projected step time (from a calibrated profile) against the measured
steady-state step time, for meshes x strategies x models; and the plan advisor's ranking against measured times.

    python -m jaxpar.calibrate --out /tmp/machine.json          # first: this machine's profile
    python -m benchmarks.costmodel --hardware /tmp/machine.json  # --parts machine,advisor
    python -m benchmarks.costmodel --parts advisor               # one command: calibrates, plans, measures

Without --hardware the benchmark calibrates first, in the same process: the links and matmul rate on
--calibrate-mesh, then the MLP's own step at --batch-size (`python -m jaxpar.calibrate --model mlp`'s profile).

`machine`: each configuration builds a Trainer with the profile, reads `jaxpar.explain`'s projected mean step time
of its strategy (the same model `sim_time` uses), then times --steps steady-state steps after 3 warm-up steps (at
most two in flight, as `fit` runs them; the median of --rounds rounds). Prints projected, measured and the
relative error (projected / measured - 1) per configuration, and the median and worst absolute error.

`advisor`: `jaxpar.plan` ranks every plan for the MLP on 8 devices with the same profile; the benchmark measures
the step time of --plans of them (spread over the ranking, the first choice among them) as `fit` runs steps, in
alternating rounds, and reports Spearman's rank correlation between projected and measured step times (over all
of them, and over the sync plans alone), and how far the advisor's first choice is from the measured best.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jaxpar
from benchmarks import common

# (model, model fields, mesh, strategy factory name, options): the meshes x strategies x two model sizes
TRANSFORMER_SMALL = {"layers": 2, "d_model": 128, "heads": 8}
TRANSFORMER_LARGE = {"layers": 4, "d_model": 256, "heads": 8, "d_ff": 1024}
CONFIGS = [
    ("mlp", {}, "8", "sync", {}),
    ("mlp", {}, "8", "sync", {"allreduce": "ring"}),
    ("mlp", {}, "8", "sync", {"allreduce": "torus2d"}),
    ("mlp", {}, "8", "sync", {"allreduce": "ps"}),
    ("mlp", {}, "8", "local_sgd", {"period": 4}),
    ("mlp", {}, "2x4", "sync", {}),
    ("transformer", TRANSFORMER_SMALL, "8", "sync", {}),
    ("transformer", TRANSFORMER_SMALL, "2x4", "sync", {}),
    ("transformer", TRANSFORMER_SMALL, "1x8", "sync", {}),
    ("transformer", TRANSFORMER_SMALL, "fsdp=8", "sync", {}),
    ("transformer", TRANSFORMER_SMALL, "data=2,fsdp=2,model=2", "sync", {}),
    ("transformer", TRANSFORMER_SMALL, "8", "local_sgd", {"period": 4}),
    ("transformer", TRANSFORMER_LARGE, "2x4", "sync", {}),
    ("transformer", TRANSFORMER_LARGE, "8", "sync", {"allreduce": "ring"}),
    ("transformer", TRANSFORMER_LARGE, "fsdp=8", "sync", {}),
    ("transformer", TRANSFORMER_LARGE, "data=2,fsdp=2,model=2", "sync", {}),
]
QUICK = [0, 3, 5, 7, 9, 12]


def strategy_of(name: str, options: dict):
    from jaxpar.strategies import REGISTRY

    return REGISTRY[name](**options)


def label(model, fields, mesh, strategy, options) -> str:
    size = "" if model == "mlp" else ("-large" if fields is TRANSFORMER_LARGE else "-small")
    extra = "".join(f" {k}={v}" for k, v in options.items())
    return f"{model}{size} --mesh {mesh} {strategy}{extra}"


def measured_step_seconds(trainer, batch, steps: int, rounds: int) -> float:
    """Median over rounds of seconds per step, as `fit` runs steps: at most two in flight and nothing read back
    (`Trainer.dispatch`; `Trainer.step` would read local SGD's per-replica metrics to the host every step)."""
    from jaxpar.calibration.model_step import time_steps

    period = getattr(trainer.strategy, "period", 1)
    steps = -(-steps // period) * period  # whole periods: the mean over local steps and meetings
    # warm-up: compile every variant (a meeting comes every period)
    return time_steps(trainer, batch, steps, rounds, warmup=3 + period)


def projected_step_seconds(trainer, batch) -> dict:
    """The projected mean step time of the trainer's strategy and its parts (compute, launch included, and the
    rest: communication less overlap), each variant weighted by its share of the steps."""
    report = jaxpar.explain(trainer, batch)
    compute = sum(v["projected_seconds"]["compute"] * (v["share"] or 0) for v in report["variants"].values())
    step = report["projection"][trainer.strategy.name]["seconds"]
    return {"step": step, "compute": compute, "rest": step - compute}


def calibrated(rows, launch: float) -> None:
    """Per model, the first configuration is the reference: the ratio of its measured time less the projected
    communication to the projected compute (launch left out) is that model's utilisation of the matmul rate; the
    other configurations of the model are projected again with it (`calibrated_s`, `calibrated_error`)."""
    reference = {}
    for row in rows:
        model = row["config"].split()[0]
        if model not in reference:
            reference[model] = (row["measured_s"] - row["rest_s"] - launch) / (row["compute_s"] - launch)
            row["reference"] = True
        k = reference[model]
        row["compute_factor"] = k
        row["calibrated_s"] = launch + k * (row["compute_s"] - launch) + row["rest_s"]
        row["calibrated_error"] = row["calibrated_s"] / row["measured_s"] - 1


def machine(args, profile) -> list[dict]:
    import optax

    rows = []
    chosen = [CONFIGS[i] for i in QUICK] if args.quick else CONFIGS
    for model, fields, mesh_spec, strategy, options in chosen:
        parts = common.setup(model, dropout=0.0, batch_size=args.batch_size, **fields)
        mesh = jaxpar.make_mesh(mesh_spec)
        trainer = jaxpar.Trainer(parts.factory, parts.loss_fn, optax.adamw(1e-3), mesh,
                                 strategy=strategy_of(strategy, options), hardware=profile)
        parts_s = projected_step_seconds(trainer, parts.batch)
        projected = parts_s["step"]
        measured = measured_step_seconds(trainer, parts.batch, args.steps, args.rounds)
        row = {"config": label(model, fields, mesh_spec, strategy, options), "projected_s": projected,
               "compute_s": parts_s["compute"], "rest_s": parts_s["rest"],
               "measured_s": measured, "error": projected / measured - 1}
        rows.append(row)
        print(f"{row['config']:<58} projected {projected * 1e3:9.3f} ms  measured {measured * 1e3:9.3f} ms  "
              f"error {row['error']:+.0%}", flush=True)
    errors = [abs(r["error"]) for r in rows]
    print(f"matmul rate as compute: median |error| {statistics.median(errors):.0%}, worst {max(errors):.0%} over "
          f"{len(rows)} configurations")
    calibrated(rows, profile.launch)
    print("with each model's utilisation measured on its first configuration (the reference, marked *):")
    for r in rows:
        mark = "*" if r.get("reference") else " "
        print(f"{mark} {r['config']:<58} projected {r['calibrated_s'] * 1e3:9.3f} ms  measured "
              f"{r['measured_s'] * 1e3:9.3f} ms  error {r['calibrated_error']:+.0%}  (utilisation "
              f"{1 / r['compute_factor']:.2f})")
    held_out = [abs(r["calibrated_error"]) for r in rows if not r.get("reference")]
    print(f"held-out configurations: median |error| {statistics.median(held_out):.0%}, worst {max(held_out):.0%} "
          f"over {len(held_out)}")
    return rows


def spearman(a, b) -> float:
    """Spearman's rank correlation (no ties expected; ties get their order of appearance)."""
    import numpy as np

    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def advisor(args, profile) -> dict:
    """Ranks the MLP's plans on 8 devices of `profile`, measures --plans of them (spread over the ranking, the first
    choice always among them) in alternating rounds, and reports Spearman's rank correlation and the first choice's
    measured time over the best measured."""
    import optax

    from jaxpar.advisor import advise
    from jaxpar.calibration.model_step import alternating_seconds, runner

    parts = common.setup("mlp", dropout=0.0, batch_size=args.batch_size)
    batch_shapes = {k: jaxpar_shape(v) for k, v in parts.batch.items()}
    result = advise(parts.factory, parts.loss_fn, optax.adamw(1e-3), batch_shapes, profile, 8, remats=("none",))
    candidates = [c for c in result["plans"] if c.fits]
    step = max(len(candidates) // args.plans, 1)
    picked = candidates[::step][: args.plans]
    if candidates[0] not in picked:
        picked = [candidates[0]] + picked[:-1]
    runs, periods = [], []
    for c in picked:
        strategy, options = _strategy_from_label(c.strategy)
        trainer = jaxpar.Trainer(parts.factory, parts.loss_fn, optax.adamw(1e-3), jaxpar.make_mesh(c.mesh),
                                 strategy=strategy_of(strategy, options))
        runs.append(runner(trainer, parts.batch))
        periods.append(getattr(trainer.strategy, "period", 1))
    whole = max(periods)  # whole periods of every plan: the mean over local steps and meetings
    steps = -(-args.steps // whole) * whole
    measured = alternating_seconds(runs, steps, args.rounds, warmup=3 + whole)
    rows = []
    for c, seconds in zip(picked, measured):
        rows.append({"plan": c.flags, "projected_s": c.seconds, "measured_s": seconds})
        print(f"{c.flags:<70} projected {c.seconds * 1e3:9.3f} ms  measured {seconds * 1e3:9.3f} ms", flush=True)
    rho = spearman([r["projected_s"] for r in rows], [r["measured_s"] for r in rows])
    best = min(r["measured_s"] for r in rows)
    family = [r for r, c in zip(rows, picked) if c.strategy.split()[0] == "sync"]
    out = {"plans": rows, "spearman": rho, "first_choice_over_best": rows[0]["measured_s"] / best,
           "candidates": len(candidates),
           "spearman_sync": spearman([r["projected_s"] for r in family], [r["measured_s"] for r in family])
           if len(family) > 2 else None}
    print(f"Spearman rank correlation over {len(rows)} of {len(candidates)} plans: {rho:.2f}; the advisor's first "
          f"choice measured {out['first_choice_over_best']:.2f}x the best measured ({steps} steps x {args.rounds} "
          f"rounds per plan, alternating)")
    if out["spearman_sync"] is not None:
        print(f"  of which the {len(family)} sync plans (compiler's or hand-written allreduce): Spearman "
              f"{out['spearman_sync']:.2f}")
    return out


def calibrated_here(args):
    """This machine's profile for the MLP, as `python -m jaxpar.calibrate --mesh M --model mlp --batch-size B`
    writes it: matmul rate, launch, every kind's link per axis of M, and the MLP's utilisation and fixed cost."""
    from jaxpar.calibration import calibrate, calibrate_model, summary
    from jaxpar.cost.profile import Profile

    say = (lambda line: print(f"calibrate: {line}", flush=True)) if args.verbose else None
    found = calibrate(jaxpar.make_mesh(args.calibrate_mesh), progress=say)
    found = calibrate_model(found, "mlp", args.batch_size, progress=say)
    print("\n".join(summary(found)), flush=True)
    if args.save_profile:
        with open(args.save_profile, "w") as handle:
            json.dump(found, handle, indent=1)
    return Profile.from_dict(found)


def jaxpar_shape(value):
    import jax

    return jax.ShapeDtypeStruct(value.shape, value.dtype)


def _strategy_from_label(text: str):
    """("sync", {"allreduce": "ring"}) from a plan's strategy label such as "sync allreduce=ring" or "local_sgd H=4"."""
    name, *rest = text.split()
    options = {}
    for item in rest:
        key, _, value = item.partition("=")
        options["period" if key == "H" else key] = int(value) if key == "H" else value
    return name, options


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default=None, help="a profile: a file from python -m jaxpar.calibrate; "
                        "default: calibrate this machine first (--calibrate-mesh, the MLP's step at --batch-size)")
    parser.add_argument("--calibrate-mesh", default="2x4", help="the mesh whose axes the calibration measures")
    parser.add_argument("--save-profile", default=None, help="write the calibrated profile here (JSON)")
    parser.add_argument("--verbose", action="store_true", help="print every calibration measurement")
    parser.add_argument("--parts", default="machine,advisor")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--plans", type=int, default=8, help="plans of the advisor to measure")
    parser.add_argument("--quick", action="store_true", help=f"{len(QUICK)} of the {len(CONFIGS)} configurations")
    args = parser.parse_args()
    jaxpar.make_mesh("8")  # before anything touches JAX: 8 CPU devices
    started = time.perf_counter()
    profile = jaxpar.parse_hardware(args.hardware) if args.hardware else calibrated_here(args)
    parts = args.parts.split(",")
    result = {"profile": profile.name, "source": profile.source}
    if "machine" in parts:
        result["machine"] = machine(args, profile)
    if "advisor" in parts:
        result["advisor"] = advisor(args, profile)
    result["seconds"] = time.perf_counter() - started
    print(f"costmodel: {result['seconds']:.0f} s in all")
    print(json.dumps(result))


def summarize(rows):
    r = rows[-1]
    out = []
    if "machine" in r:
        errors = [abs(x["error"]) for x in r["machine"]]
        held = [abs(x["calibrated_error"]) for x in r["machine"] if not x.get("reference")]
        out.append(f"projected vs measured step time, matmul rate as compute: median |error| "
                   f"{statistics.median(errors):.0%}, worst {max(errors):.0%} ({len(errors)} configurations); with "
                   f"each model's utilisation from one reference run: median {statistics.median(held):.0%}, worst "
                   f"{max(held):.0%} ({len(held)} held out)")
    if "advisor" in r:
        out.append(f"advisor: Spearman {r['advisor']['spearman']:.2f} over {len(r['advisor']['plans'])} plans")
    return out


if __name__ == "__main__":
    main()
