"""Gradient compression in training: convergence with and without error feedback, time to a target loss on a
slow-link profile (the cost model), and the step-time cost of encoding / decoding on this machine.

    python -m benchmarks.compression_convergence --part convergence --out /tmp/cc.json   # trains; losses
    python -m benchmarks.compression_convergence --part time --load /tmp/cc.json         # prices those runs
    python -m benchmarks.compression_convergence --part cost                              # steps/s, alternating

Convergence (`--part convergence`, mesh `8`, Sync(allreduce="psum", compress=CODEC) for every codec of `CODECS`,
"none" being the same explicit exchange uncompressed): the two tasks of `benchmarks.strategies` (the digits MLP,
hidden 128, batch 64; the 1-layer byte-level transformer, d_model 64, batch 32), adam lr 3e-3, dropout 0, the same
steps for every codec, at seeds 0, 1, 2 (the seed initialises the model and orders the batches). Final training
loss = the mean of the last 10 steps' losses; held-out: the MLP's test loss and accuracy (296 test digits), the
transformer's loss on 4 held-out batches. Losses do not depend on the machine's load.

Time to target (`--part time`): per seed, the target is the lowest 10-step mean training loss the uncompressed
run reaches within its first half (rounded up to 3 decimals); steps to target = the first step whose 10-step mean
is <= it; seconds to target = the strategy's simulated clock after that many steps, each step priced by the cost
model from its compiled variant on each profile of `PROFILES` (`jaxpar.cost.hardware.compiled_cost`, which counts
the compressed bytes in the HLO and the codec's compute: XLA's FLOPs plus PowerSGD's orthogonalisation). A
projection, not a measurement. Strategy specs are a list (`STRATEGIES`): sync, and local SGD H=4 with the codec at
its meetings when `jaxpar.LocalSGD` accepts `compress` (else those rows are skipped with a printed note).

Step-time cost (`--part cost`): steps/s of each codec's train step on mesh `8` on this machine, in alternating
rounds (`common.alternating_rates`), as a ratio to the uncompressed explicit exchange (on CPU devices of one host
the link is memory: compression can only cost here).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import jaxpar
from benchmarks import common

CODECS = ("none", "bf16", "fp16", "int8", "int8:noef", "powersgd:4", "powersgd:4:noef")
TIME_CODECS = ("none", "bf16", "int8", "powersgd:4")
SEEDS = (0, 1, 2)
STEPS = {"mlp": 300, "transformer": 300}
MESH = "8"
SMOOTH = 10
# (label, --hardware spec): a slow data link. a100-eth10 is 10 Gb/s Ethernet with 50 us per message; the second
# keeps its latency and cuts the bandwidth to 1 Gb/s, where these small models' gradients are bandwidth-bound.
PROFILES = (("eth10", "a100-eth10"), ("eth1", "a100-eth10,data.bandwidth=1.25e8"))


def _local_sgd(codec):
    return jaxpar.LocalSGD(period=4, allreduce="psum", compress=None if codec == "none" else codec)


# (label, factory(codec) -> strategy); a factory that raises TypeError (no `compress` argument) skips its rows
STRATEGIES = [
    ("sync", lambda codec: jaxpar.Sync(allreduce="psum", compress=codec)),
    ("local_sgd H=4", _local_sgd),
]


def available(build, codec):
    """The strategy, or None with a note when this version of jaxpar cannot build it."""
    try:
        return build(codec)
    except TypeError as error:
        print(f"note: skipped ({error}): this jaxpar has no compression at that strategy's meetings", flush=True)
        return None


def optimizer(name: str = "adam"):
    """adam lr 3e-3 (the default); momentum: SGD lr 0.05, momentum 0.9, the optimizer PowerSGD's paper trains with
    (Vogels et al. 2019 use SGD with momentum; Adam's per-coordinate scaling meets a low-rank gradient differently)."""
    import optax

    return {"adam": lambda: optax.adam(3e-3), "momentum": lambda: optax.sgd(0.05, momentum=0.9)}[name]()


def train(task, label, build, codec, seed, steps, task_parts, mesh, optimizer_name="adam"):
    """One run: per-step losses, the final 10-step mean, held-out metrics, wall seconds."""
    from benchmarks.strategies import smoothed

    strategy = available(build, codec)
    if strategy is None:
        return None
    parts, batches, held_out = task_parts
    trainer = common.trainer(parts, mesh, optimizer(optimizer_name), strategy=strategy)
    losses = []
    start = time.perf_counter()
    state = trainer.fit(trainer.init(seed), batches(seed), steps,
                        on_step=lambda step, metrics: losses.append(float(metrics["loss"])))
    held = held_out(trainer, state)
    return {"task": task, "strategy": label, "codec": codec, "seed": seed, "steps": steps, "losses": losses,
            "optimizer": optimizer_name, "smoothed": smoothed(losses), "final_train_loss": sum(losses[-SMOOTH:]) / SMOOTH, **held,
            "wall_seconds": time.perf_counter() - start}


def convergence(args, mesh):
    from benchmarks.strategies import make_task

    runs = []
    for task in args.tasks.split(","):
        task_parts = make_task(task)
        for label, build in STRATEGIES:
            if args.strategies and label not in args.strategies.split(","):
                continue
            for codec in (args.codecs.split(",") if args.codecs else CODECS if label == "sync" else TIME_CODECS):
                for seed in SEEDS[:args.seeds]:
                    run = train(task, label, build, codec, seed, args.steps or STEPS[task], task_parts, mesh,
                                args.optimizer)
                    if run is None:
                        break
                    runs.append(run)
                    print(json.dumps({k: v for k, v in run.items() if k not in ("losses", "smoothed")}), flush=True)
                else:
                    continue
                break  # the strategy cannot be built: its other codecs neither
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(runs, f)
    convergence_table(runs)
    return runs


def _mean_sd(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def convergence_table(runs):
    for task in dict.fromkeys(r["task"] for r in runs):
        held = "test_loss" if task == "mlp" else "val_loss"
        rows = [r for r in runs if r["task"] == task]
        # each strategy against its own uncompressed run of the same seed
        base = {(r["strategy"], r["seed"]): r for r in rows if r["codec"] == "none"}
        seeds = len({r["seed"] for r in rows})
        print(f"\n{task}: mesh {MESH}, {rows[0]['steps']} steps, seeds {sorted({r['seed'] for r in rows})}; mean (sd) "
              f"over seeds; 'vs none': the mean over seeds of each run / the same strategy's uncompressed run of its "
              f"seed - 1\n")
        print(f"| strategy | codec | final training loss | vs none | held-out loss | vs none |"
              + (" test accuracy |" if task == "mlp" else ""))
        print("|---|---|---|---|---|---|" + ("---|" if task == "mlp" else ""))
        for (label, codec) in dict.fromkeys((r["strategy"], r["codec"]) for r in rows):
            group = [r for r in rows if (r["strategy"], r["codec"]) == (label, codec)]
            cells = []
            for key in ("final_train_loss", held):
                mean, sd = _mean_sd([r[key] for r in group])
                rels = [r[key] / base[label, r["seed"]][key] - 1 for r in group if (label, r["seed"]) in base]
                rel = f"{100 * statistics.mean(rels):+.2f}%" if rels else "-"
                cells.append(f"{mean:.4f} ({sd:.4f}) | {rel}" if math.isfinite(mean) else "diverged | -")
            if task == "mlp":
                mean, sd = _mean_sd([r["test_accuracy"] for r in group])
                cells.append(f"{mean:.4f} ({sd:.4f})")
            print(f"| {label} | {codec} | " + " | ".join(cells) + " |")
        if seeds < len(SEEDS):
            print(f"(only {seeds} seed(s))")


def priced_clock(trainer, strategy, profile, batch, steps):
    """sim_time after each step, each variant priced from its compiled step on `profile` (what
    `Trainer(hardware=...)` does: `jaxpar.cost.step_pricer.StepPricer`)."""
    from jaxpar.cost.step_pricer import StepPricer
    from jaxpar.cost.strategy_costs import variant_shares

    pricer = StepPricer(profile)
    pricer.attach(trainer)
    first = strategy.plan(trainer.ctx, 0)
    costs = {}
    for variant in variant_shares(strategy):
        costs[variant] = pricer.price(variant, trainer.compiled_step(variant, batch,
                                                                     first.inputs if first.variant == variant else {}))
    clock = strategy.clock.priced(costs.__getitem__)
    return [clock.time_after(trainer.num_replicas, n) for n in range(steps)], costs


def time_to_target(args, mesh, runs):
    import optax

    from benchmarks.strategies import first_reaching, make_task
    from jaxpar.cost.hardware import parse_hardware

    results = []
    for task in dict.fromkeys(r["task"] for r in runs):
        parts, batches, _ = task_parts = make_task(task)
        batch = next(iter(batches(0)))
        rows = [r for r in runs if r["task"] == task and r["codec"] in TIME_CODECS]
        targets = {}
        for r in rows:
            if r["strategy"] == "sync" and r["codec"] == "none":
                half = r["smoothed"][: max(r["steps"] // 2, 1)]
                targets[r["seed"]] = math.ceil(min(half) * 1000) / 1000
        for (label, codec) in dict.fromkeys((r["strategy"], r["codec"]) for r in rows):
            build = dict(STRATEGIES)[label]
            strategy = build(codec)
            trainer = common.trainer(task_parts[0], mesh, optax.adam(3e-3), strategy=strategy)
            trainer.init(0)
            group = [r for r in rows if (r["strategy"], r["codec"]) == (label, codec)]
            for name, spec in PROFILES:
                clock, costs = priced_clock(trainer, strategy, parse_hardware(spec), batch, group[0]["steps"])
                reached = []
                for r in group:
                    hit = first_reaching([{"step": i + 1, "smoothed_loss": v} for i, v in enumerate(r["smoothed"])],
                                         targets[r["seed"]])
                    reached.append(None if hit is None else hit["step"])
                seconds = [None if s is None else clock[s - 1] for s in reached]
                row = {"task": task, "strategy": label, "codec": codec, "profile": name, "hardware": spec,
                       "steps_to_target": reached, "sim_seconds_to_target": seconds,
                       "mean_step_seconds": clock[-1] / len(clock),
                       "step_seconds": {v: {"compute": c.compute, "comm": c.comm, "exposed": c.exposed}
                                        for v, c in costs.items()},
                       "targets": [targets[r["seed"]] for r in group]}
                results.append(row)
                print(json.dumps(row), flush=True)
    time_table(results)
    return results


def time_table(results):
    for task in dict.fromkeys(r["task"] for r in results):
        rows = [r for r in results if r["task"] == task]
        print(f"\n{task}: time to target on a slow data link (cost model projection; mean over seeds of the runs "
              f"that reached it; targets per seed {rows[0]['targets']})\n")
        names = list(dict.fromkeys(r["profile"] for r in rows))
        print("| strategy | codec | steps to target (per seed) | " +
              " | ".join(f"{n}: ms per step | {n}: ms to target" for n in names) + " |")
        print("|---|---|---|" + "---|---|" * len(names))
        for (label, codec) in dict.fromkeys((r["strategy"], r["codec"]) for r in rows):
            cells = [r for r in rows if (r["strategy"], r["codec"]) == (label, codec)]
            steps = cells[0]["steps_to_target"]
            parts = []
            for r in cells:
                per_step = r["mean_step_seconds"]
                hit = [s for s in r["sim_seconds_to_target"] if s is not None]
                parts.append(f"{per_step * 1e3:.4g} | " + (f"{statistics.mean(hit) * 1e3:.4g}" if hit else "never"))
            shown = ", ".join("never" if s is None else str(s) for s in steps)
            print(f"| {label} | {codec} | {shown} | " + " | ".join(parts) + " |")
        print("\nprofiles: " + "; ".join(f"{n} = {spec}" for n, spec in PROFILES) + ". ms per step: the simulated "
              "clock after the last step / the steps (sync: compute + exposed communication of the compiled step; "
              "local SGD: its local steps and meetings as its clock runs them)")


def step_cost(args, mesh):
    import optax

    from benchmarks.strategies import make_task

    results = []
    for task in args.tasks.split(","):
        parts, batches, _ = make_task(task)
        batch = next(iter(batches(0)))
        steps = {}
        chosen = ("none", *(c for c in args.codecs.split(",") if c != "none")) if args.codecs else (
            TIME_CODECS + ("powersgd:4:noef", "int8:noef"))  # none: every ratio's base
        for codec in chosen:
            trainer = common.trainer(parts, mesh, optax.adam(3e-3),
                                     strategy=jaxpar.Sync(allreduce=args.allreduce, compress=codec))
            holder = {"state": trainer.init(0)}

            def one(trainer=trainer, holder=holder):
                holder["state"], metrics = trainer.step(holder["state"], batch)
                return metrics

            steps[codec] = one
        rates = common.alternating_rates(steps, args.rounds, args.per_round)
        base = rates["none"]
        print(f"\n{task}: steps/s on mesh {args.mesh} (allreduce {args.allreduce}) on this machine, "
              f"{args.rounds} alternating rounds of {args.per_round} steps; ratio = the median over rounds of "
              f"(codec / none in that round)\n")
        print("| codec | steps/s (median) | ratio to none | rounds' ratios |")
        print("|---|---|---|---|")
        for codec, r in rates.items():
            ratios = [a / b for a, b in zip(r, base)]
            row = {"task": task, "codec": codec, "rates": r, "ratio": statistics.median(ratios)}
            results.append(row)
            print(json.dumps(row), flush=True)
            print(f"| {codec} | {statistics.median(r):.1f} | {row['ratio']:.3f} | "
                  f"{min(ratios):.3f}-{max(ratios):.3f} |")
    return results


def summarize(rows: list[dict]) -> list[str]:
    """The suite's summary cell (`python -m benchmarks`): step-time ratios, final losses or steps to target."""
    lines = []
    for r in rows:
        if "ratio" in r:
            lines.append(f"{r['task']} {r['codec']}: {r['ratio']:.3f} of uncompressed steps/s")
        elif "final_train_loss" in r:
            lines.append(f"{r['task']} {r['strategy']} {r['codec']} seed {r['seed']}: final loss "
                         f"{r['final_train_loss']:.4f}")
        elif "steps_to_target" in r:
            lines.append(f"{r['task']} {r['strategy']} {r['codec']} {r['profile']}: steps {r['steps_to_target']}")
    return lines or [f"{len(rows)} JSON rows"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="all", choices=["convergence", "time", "cost", "all"])
    parser.add_argument("--tasks", default="mlp,transformer")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: 300)")
    parser.add_argument("--codecs", default=None, help=f"codecs separated by ',' (default: {','.join(CODECS)}; "
                                                        f"local SGD: {','.join(TIME_CODECS)})")
    parser.add_argument("--strategies", default=None, help="labels of STRATEGIES separated by ',' (default: all)")
    parser.add_argument("--optimizer", default="adam", choices=["adam", "momentum"],
                        help="--part convergence: adam lr 3e-3 (default) or SGD lr 0.05 momentum 0.9")
    parser.add_argument("--seeds", type=int, default=len(SEEDS), choices=range(1, len(SEEDS) + 1))
    parser.add_argument("--out", default=None, help="JSON file for the convergence runs (with per-step losses)")
    parser.add_argument("--load", default=None, help="--part time: the runs of an earlier --part convergence --out")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=30)
    parser.add_argument("--mesh", default=MESH, help="--part cost: the mesh the steps run on (default: 8)")
    parser.add_argument("--allreduce", default="psum", help="--part cost: the algorithm over data (default: psum)")
    args = parser.parse_args()
    # before anything touches JAX: provides the CPU devices
    mesh = jaxpar.make_mesh(args.mesh if args.part == "cost" else MESH)
    if args.part == "time" and not args.load:
        parser.error("--part time needs --load FILE (the JSON of --part convergence --out FILE)")
    runs = None
    if args.part in ("convergence", "all"):
        runs = convergence(args, mesh)
    if args.part in ("time", "all"):
        if runs is None:
            with open(args.load, encoding="utf-8") as f:
                runs = json.load(f)
        time_to_target(args, mesh, runs)
    if args.part in ("cost", "all"):
        step_cost(args, mesh)


if __name__ == "__main__":
    main()
