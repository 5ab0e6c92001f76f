"""Update strategies under two hardware profiles: steps and simulated seconds to a target loss, and held-out quality.

    python -m benchmarks.strategies                                   # both tasks, default steps
    python -m benchmarks.strategies --task mlp --max-steps 320 --out benchmarks/strategies.jsonl

Mesh "4x2" (4 data replicas x 2-way tensor parallel). Strategies, all built from the library classes: sync,
local_sgd H=4, local_sgd H=16, diloco (H=4, outer Nesterov lr 0.7 / momentum 0.9), ssp S=2, asp.

Scenarios (`SCENARIOS`): "fast link" = profile `a100-nvlink` (every axis NVLink), nobody slow; "slow link +
straggler" = profile `a100-eth10` (the data axis on 10 Gb/s Ethernet) with replica 3 computing 2x slower
(`stragglers="3:2.0"`); "slow devices + slow link + straggler" = 1 GFLOP/s devices on 10 Gb/s Ethernet links
(`flops=1e9,alpha=5e-5,bandwidth=1.25e9`) with the same straggler: on an A100 these small models' steps take
nanoseconds of compute against hundreds of microseconds of communication, so a straggler's slower compute is
invisible; on 1 GFLOP/s devices compute and communication are of the same order, the regime where waiting for a
straggler costs. Sync and local SGD / DiLoCo apply the same updates whoever is slow, so each trains once and
its clock is priced under both scenarios; SSP / ASP decide who delivers from the straggler profile, so they train
once per scenario (without a straggler they are sync SGD, update for update).

Tasks (real data, adam lr 3e-3, dropout 0, seed 0, every strategy sees the same batches in the same order):

- `mlp`: the digits MLP (hidden 128), global batch 64 (16 per replica); held-out: accuracy on the first 296 of the
  300 test digits (296 divides by the data axis).
- `transformer`: a small byte-level LM (1 layer, d_model 64, 4 heads, d_ff 256, seq_len 64), global batch 32, on
  the first MiB of the default corpus; held-out: mean loss (nats/byte) over 4 batches of its last 5%.

Every strategy trains the full `--max-steps` updates (`jaxpar.Trainer.fit`). The loss is noisy per step, so
"reached" uses the 10-step trailing mean of the training loss. The target is `--target-loss` or, by default, the
lowest 10-step mean the sync run reaches within the first half of its steps (rounded up to 3 decimals).

Simulated seconds: each step variant is compiled, and priced by `jaxpar.cost.hardware` (its FLOPs per device / the
profile's peak, plus the alpha-beta cost of the collectives its HLO contains on the links of the axes they span);
the one event simulator (`jaxpar.strategies.simulation.simulate`) turns those prices and the straggler profile into
the clock, exactly as `Trainer(hardware=...)` / `run.py --hardware` does. It is a projection onto the profile's
hardware, not a measurement; wall times on this machine are in the JSON rows.
"""

import argparse
import json
import math
import os
import time

import jaxpar
from benchmarks import common
from benchmarks.report import num

STRAGGLERS = "3:2.0"
DEFAULT_STEPS = {"mlp": 320, "transformer": 320}
SMOOTH = 10  # trailing window of the smoothed loss
# (label, hardware profile, straggler profile): the simulated clock of every run is priced under each
SCENARIOS = (("fast link", "a100-nvlink", None), ("slow link + straggler", "a100-eth10", STRAGGLERS),
             ("slow devices + slow link + straggler", "flops=1e9,alpha=5e-5,bandwidth=1.25e9", STRAGGLERS))


def strategies(steps):
    """(label, factory(stragglers), whether its updates depend on the straggler profile); sync first: the default
    target comes from it. Sync and local SGD / DiLoCo apply the same updates whoever is slow (only their clock
    changes); SSP / ASP's schedule of who delivers depends on it, so they train once per straggler profile."""
    return [
        ("sync", lambda s: jaxpar.Sync(stragglers=s), False),
        ("local_sgd H=4", lambda s: jaxpar.LocalSGD(period=4, stragglers=s), False),
        ("local_sgd H=16", lambda s: jaxpar.LocalSGD(period=16, stragglers=s), False),
        ("diloco H=4", lambda s: jaxpar.DiLoCo(period=4, stragglers=s), False),
        ("ssp S=2", lambda s: jaxpar.SSP(staleness=2, stragglers=s, horizon=steps), True),
        ("asp", lambda s: jaxpar.ASP(stragglers=s, horizon=steps), True),
    ]


def priced_times(trainer, strategy, hardware, batch, steps):
    """sim_time after each step of `trainer`'s run, priced on `hardware` from its compiled step variants (the same
    event simulation and cost model as `Trainer(hardware=...)`)."""
    from jaxpar.cost.hardware import compiled_cost, parse_hardware
    from jaxpar.cost.strategy_costs import variant_shares

    profile = parse_hardware(hardware)
    first = strategy.plan(trainer.ctx, 0)
    costs = {}
    for variant in variant_shares(strategy):
        compiled = trainer.compiled_step(variant, batch, first.inputs if first.variant == variant else {})
        costs[variant] = compiled_cost(compiled, trainer.mesh, profile)
    clock = strategy.clock.priced(costs.__getitem__)
    return [clock.time_after(trainer.num_replicas, n) for n in range(steps)], costs


def make_task(name):
    """(`common.Setup` of the task's model, batch iterator factory(seed), held-out evaluation(trainer, state) ->
    dict)."""
    import jax

    from jaxpar.io import data

    if name == "mlp":
        parts = common.setup("mlp", dropout=0.0, hidden=128, batch_size=64)
        test = {k: v[:296] for k, v in data.load_digits()[1].items()}

        def held_out(trainer, state):
            metrics = jax.device_get(trainer.evaluate(state, test))
            return {"test_accuracy": float(metrics["accuracy"]), "test_loss": float(metrics["loss"])}

        return parts, lambda seed: common.batches(parts.config, seed), held_out

    parts = common.setup("transformer", dropout=0.0, layers=1, d_model=64, heads=4, d_ff=256, seq_len=64,
                         batch_size=32)
    config = parts.config
    train_tokens, val_tokens = data.split_text(data.load_text(max_bytes=common.TEXT_BYTES), seq_len=config.seq_len)
    val_batches = [b for _, b in zip(range(4), data.text_batches(val_tokens, config.batch_size, config.seq_len, 1))]

    def held_out(trainer, state):
        losses = [float(jax.device_get(trainer.evaluate(state, b))["loss"]) for b in val_batches]
        return {"val_loss": sum(losses) / len(losses)}

    return parts, lambda seed: data.text_batches(train_tokens, config.batch_size, config.seq_len, seed), held_out


def smoothed(losses):
    out, total = [], 0.0
    for i, value in enumerate(losses):
        total += value - (losses[i - SMOOTH] if i >= SMOOTH else 0.0)
        out.append(total / min(i + 1, SMOOTH))
    return out


def first_reaching(records, target):
    """The first record whose smoothed loss is <= target, or None."""
    return next((r for r in records if r["smoothed_loss"] <= target), None)


def run_strategy(task, label, strategy, mesh, steps, task_parts):
    import jax
    import optax

    parts, batches, held_out = task_parts
    trainer = common.trainer(parts, mesh, optax.adam(3e-3), strategy=strategy)

    start = time.perf_counter()
    warm = getattr(strategy, "period", 1) + 1  # every step variant (local, meet, ...) compiled at least once
    trainer.fit(trainer.init(0), batches(1000), warm)
    held_out(trainer, trainer.init(0))  # compiles the evaluation step too
    setup = time.perf_counter() - start

    records = []

    def on_step(step, metrics):
        records.append({"task": task, "strategy": label, "step": step, **metrics,
                        "wall": time.perf_counter() - started})

    state = trainer.init(0)
    jax.block_until_ready(state)
    started = time.perf_counter()
    state = trainer.fit(state, batches(0), steps, on_step=on_step)
    wall = time.perf_counter() - started
    for record, value in zip(records, smoothed([r["loss"] for r in records])):
        record["smoothed_loss"] = value
    return records, held_out(trainer, state), wall, setup, trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="both", choices=["mlp", "transformer", "both"])
    parser.add_argument("--max-steps", type=int, default=None,
                        help=f"updates per strategy (default: {DEFAULT_STEPS['mlp']} mlp, "
                             f"{DEFAULT_STEPS['transformer']} transformer)")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="smoothed training loss to reach (default: from the sync run, see above)")
    parser.add_argument("--mesh", default="4x2")
    parser.add_argument("--out", default=None, help="JSONL file for every per-step record (default: none)")
    args = parser.parse_args()
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        parser.error(f"--out {args.out!r}: its folder does not exist")
    mesh = jaxpar.make_mesh(args.mesh)  # before anything touches JAX: provides the CPU devices

    tasks = ["mlp", "transformer"] if args.task == "both" else [args.task]
    out = open(args.out, "w", encoding="utf-8") if args.out else None
    total_start = time.perf_counter()
    summaries = []
    try:
        for task in tasks:
            steps = args.max_steps or DEFAULT_STEPS[task]
            task_parts = make_task(task)
            target = args.target_loss
            rows = []
            for label, build, scheduled in strategies(steps):
                runs = {}  # straggler profile -> the run (sync / local SGD: one run serves every scenario)
                for scenario, hardware, stragglers in SCENARIOS:
                    key = stragglers if scheduled else None
                    if key not in runs:
                        strategy = build(key)
                        runs[key] = (strategy, *run_strategy(task, label, strategy, mesh, steps, task_parts))
                        print(f"  {label:15s} stragglers {key or 'none'}: {runs[key][3]:.1f} s training, "
                              f"{runs[key][4]:.1f} s setup", flush=True)
                    strategy, records, held, wall, setup, trainer = runs[key]
                    if target is None:  # sync runs first
                        half = records[: max(steps // 2, 1)]
                        target = math.ceil(min(r["smoothed_loss"] for r in half) * 1000) / 1000
                        print(f"{task}: target = {target:.3f}, the lowest {SMOOTH}-step mean training loss of sync "
                              f"within its first {len(half)} steps", flush=True)
                    clocked = build(stragglers)  # the scenario's straggler profile prices the clock
                    batch = next(iter(task_parts[1](0)))
                    times, costs = priced_times(trainer, clocked, hardware, batch, steps)
                    hit = first_reaching(records, target)
                    row = {"task": task, "strategy": label, "scenario": scenario, "hardware": hardware,
                           "mesh": args.mesh, "stragglers": stragglers, "max_steps": steps, "target_loss": target,
                           "steps_to_target": hit["step"] if hit else None,
                           "sim_seconds_to_target": times[hit["step"] - 1] if hit else None,
                           "wall_to_target": hit["wall"] if hit else None,
                           "final_smoothed_loss": records[-1]["smoothed_loss"], "final_sim_seconds": times[-1],
                           "step_costs": {v: {"compute": c.compute, "comm": c.comm} for v, c in costs.items()},
                           "wall_seconds": wall, "setup_seconds": setup, **held}
                    rows.append(row)
                    if out:
                        for record, t in zip(records, times):
                            out.write(json.dumps({**record, "scenario": scenario, "sim_seconds": t}) + "\n")
            summaries.append((task, steps, target, rows))
            print_table(task, steps, target, rows, args.mesh)
    finally:
        if out:
            out.close()
    for _, _, _, rows in summaries:
        for row in rows:
            print(json.dumps(row))
    print(f"total {time.perf_counter() - total_start:.1f} s")


def print_table(task, steps, target, rows, mesh):
    metric = "test_accuracy" if task == "mlp" else "val_loss"
    scenarios = [name for name, _, _ in SCENARIOS]
    print(f"\n{task}: mesh {mesh}, {steps} steps, target smoothed loss {target:.3f}; simulated seconds (a "
          f"projection: compiled FLOPs / peak + alpha-beta cost of the compiled collectives)\n")
    print("| strategy | " + " | ".join(f"{s}: steps | {s}: sim ms to target" for s in scenarios) +
          f" | final loss | {metric} |")
    print("|---" * (2 + 2 * len(scenarios) + 1) + "|")
    by_strategy: dict = {}
    for r in rows:
        by_strategy.setdefault(r["strategy"], {})[r["scenario"]] = r
    for label, cells in by_strategy.items():
        parts = []
        for s in scenarios:
            r = cells[s]
            parts.append("never | -" if r["steps_to_target"] is None else
                         f"{r['steps_to_target']} | {r['sim_seconds_to_target'] * 1e3:.3f}")
        last = cells[scenarios[-1]]
        print(f"| {label} | " + " | ".join(parts) + f" | {last['final_smoothed_loss']:.3f} | {last[metric]:.4f} |")
    profiles = "; ".join(f"{name}: {hardware}, stragglers {stragglers or 'none'}" for name, hardware, stragglers
                         in SCENARIOS)
    print(f"\nscenarios: {profiles}. steps: the first step whose {SMOOTH}-step mean training loss is <= "
          f"{target:.3f}; sim ms: the simulated clock then. Final loss and {metric} of the slow-link run (local SGD / "
          f"DiLoCo: the anchor's). Step costs (compute, comm in seconds) per variant are in the JSON rows.")


LABEL_KEYS = ("task", "scenario", "profile", "hardware", "strategy")


def summarize(rows):
    """The suite's summary cell (`python -m benchmarks`): every row's label and its `*_to_target` keys."""
    lines = []
    for r in rows:
        targets = {k: v for k, v in r.items() if k.endswith("_to_target")}
        if not targets:
            continue
        label = " / ".join(str(r[k]) for k in LABEL_KEYS if isinstance(r.get(k), (str, int, float)))
        if not label:
            label = " / ".join(str(v) for v in r.values() if isinstance(v, str))
        shown = ", ".join(f"{k.removesuffix('_to_target')} {'never' if v is None else num(v)}"
                          for k, v in targets.items())
        lines.append(f"{label}: {shown}")
    if not lines:
        return [f"{len(rows)} JSON rows, none with a `*_to_target` key"]
    targets = {str(r.get("task", "all")): r["target_loss"] for r in rows if "target_loss" in r}
    if targets:
        lines.insert(0, "target loss: " + ", ".join(f"{t} {num(v)}" for t, v in targets.items()))
    return lines


if __name__ == "__main__":
    main()
