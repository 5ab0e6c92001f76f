"""Update strategies with a straggler: steps, simulated time and wall time to a target loss, and held-out quality.

    python benchmarks/strategies.py                                   # both tasks, default steps
    python benchmarks/strategies.py --task mlp --max-steps 320 --out benchmarks/strategies.jsonl

Mesh "4x2" (4 data replicas x 2-way tensor parallel); replica 3 computes 2x slower than the others
(`stragglers="3:2.0"`, no jitter). Strategies, all built from the library classes with that straggler profile:
sync, local_sgd H=4, local_sgd H=16, diloco (H=4, outer Nesterov lr 0.7 / momentum 0.9), ssp S=2, asp.

Tasks (real data, adam lr 3e-3, dropout 0, seed 0, every strategy sees the same batches in the same order):

- `mlp`: the digits MLP (hidden 128), global batch 64 (16 per replica); held-out: accuracy on the first 296 of the
  300 test digits (296 divides by the data axis).
- `transformer`: a small byte-level LM (1 layer, d_model 64, 4 heads, d_ff 256, seq_len 64), global batch 32, on
  the first MiB of the default corpus; held-out: mean loss (nats/byte) over 4 batches of its last 5%.

Every strategy trains the full `--max-steps` updates (`jaxpar.Trainer.fit`; its `on_step` collects `loss`, `sim_time`
and the other metrics). The loss is noisy per step, so "reached" uses the 10-step trailing mean of the training
loss. The target is `--target-loss` or, by default, the lowest 10-step mean the sync run reaches within the first
half of its steps (rounded up to 3 decimals): sync reaches it at about max_steps / 2 by construction, and the
others are measured against it. "sim t" is the simulated clock (`sim_time`: a fast replica's gradient costs 1.0,
the straggler's 2.0; communication is free) at that step; "wall" is seconds of training after compilation
(each trainer is compiled and warmed up on a throw-away state first, "setup" seconds, not counted).

How to read it: a step of sync or of local SGD / DiLoCo costs the straggler's 2.0 simulated seconds (local SGD
lets replicas run at their own pace between meetings, but with a constant straggler the fast ones still wait for
it at every meeting; only jitter would be hidden), while SSP/ASP apply an update whenever gradients arrive (about
every 1.0), some of them stale or from only 3 of 4 replicas. Local SGD / DiLoCo save communication (a meeting
every H steps instead of an all-reduce every step), which this clock does not charge. For local SGD / DiLoCo
the training loss is the mean of the replicas' own losses, while `trainer.evaluate` uses the anchor (the
parameters of the last meeting), so the default step counts are multiples of 16 to end on a meeting.

Mesh: "4x2" is the default (16 digits / 8 sequences per replica). `--mesh 8` was measured too and is not better:
the same total time (77.1 s vs 76.4 s), sync the same result to every printed digit (it is mesh-invariant), and
local SGD worse (its replicas average models that each saw only 8 digits / 4 sequences per step). On 4x2 every
step also carries the tensor-parallel all-reduces over `model`, so a local SGD step, which has no gradient
all-reduce over `data`, is not cheaper in wall time here.

All wall times are from 8 CPU devices emulated on 2 shared cores; the simulated clock is the number to compare.
"""

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxpar  # noqa: E402

STRAGGLERS = "3:2.0"
DEFAULT_STEPS = {"mlp": 320, "transformer": 320}
SMOOTH = 10  # trailing window of the smoothed loss


def strategies(steps):
    """(label, factory) in the order they run; sync first: the default target comes from it."""
    return [
        ("sync", lambda: jaxpar.Sync(stragglers=STRAGGLERS)),
        ("local_sgd H=4", lambda: jaxpar.LocalSGD(period=4, stragglers=STRAGGLERS)),
        ("local_sgd H=16", lambda: jaxpar.LocalSGD(period=16, stragglers=STRAGGLERS)),
        ("diloco H=4", lambda: jaxpar.DiLoCo(period=4, stragglers=STRAGGLERS)),
        ("ssp S=2", lambda: jaxpar.SSP(staleness=2, stragglers=STRAGGLERS, horizon=steps)),
        ("asp", lambda: jaxpar.ASP(stragglers=STRAGGLERS, horizon=steps)),
    ]


def make_task(name):
    """(model factory, loss_fn, batch iterator factory(seed), held-out evaluation(trainer, state) -> dict)."""
    import jax

    import models
    from jaxpar import data

    if name == "mlp":
        config = jaxpar.Config(model="mlp", dropout=0.0, hidden=128, batch_size=64)
        train, test = data.load_digits()
        test = {k: v[:296] for k, v in test.items()}

        def held_out(trainer, state):
            metrics = jax.device_get(trainer.evaluate(state, test))
            return {"test_accuracy": float(metrics["accuracy"]), "test_loss": float(metrics["loss"])}

        return (models.factory(config), models.LOSSES["mlp"],
                lambda seed: data.array_batches(train, config.batch_size, seed, "digits training split"), held_out)

    config = jaxpar.Config(model="transformer", dropout=0.0, layers=1, d_model=64, heads=4, d_ff=256, seq_len=64,
                           batch_size=32)
    train_tokens, val_tokens = data.split_text(data.load_text(max_bytes=1 << 20), seq_len=config.seq_len)
    val_batches = [b for _, b in zip(range(4), data.text_batches(val_tokens, config.batch_size, config.seq_len, 1))]

    def held_out(trainer, state):
        losses = [float(jax.device_get(trainer.evaluate(state, b))["loss"]) for b in val_batches]
        return {"val_loss": sum(losses) / len(losses)}

    return (models.factory(config), models.LOSSES["transformer"],
            lambda seed: data.text_batches(train_tokens, config.batch_size, config.seq_len, seed), held_out)


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

    factory, loss_fn, batches, held_out = task_parts
    trainer = jaxpar.Trainer(factory, loss_fn, optax.adam(3e-3), mesh, strategy=strategy)

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
    return records, held_out(trainer, state), wall, setup


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
            parts = make_task(task)
            target = args.target_loss
            rows = []
            for label, build in strategies(steps):
                records, held, wall, setup = run_strategy(task, label, build(), mesh, steps, parts)
                if target is None:  # sync runs first
                    half = records[: max(steps // 2, 1)]
                    target = math.ceil(min(r["smoothed_loss"] for r in half) * 1000) / 1000
                    print(f"{task}: target = {target:.3f}, the lowest {SMOOTH}-step mean training loss of sync "
                          f"within its first {len(half)} steps", flush=True)
                hit = first_reaching(records, target)
                row = {"task": task, "strategy": label, "mesh": args.mesh, "stragglers": STRAGGLERS,
                       "max_steps": steps, "target_loss": target,
                       "steps_to_target": hit["step"] if hit else None,
                       "sim_time_to_target": hit["sim_time"] if hit else None,
                       "wall_to_target": hit["wall"] if hit else None,
                       "final_smoothed_loss": records[-1]["smoothed_loss"], "final_sim_time": records[-1]["sim_time"],
                       "wall_seconds": wall, "setup_seconds": setup, **held}
                rows.append(row)
                print(f"  {label:15s} done: {wall:.1f} s training, {setup:.1f} s setup", flush=True)
                if out:
                    for record in records:
                        out.write(json.dumps(record) + "\n")
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
    metric = "test acc" if task == "mlp" else "val loss"
    print(f"\n{task}: mesh {mesh}, stragglers {STRAGGLERS}, {steps} steps, target smoothed loss {target:.3f}")
    print(f"{'strategy':16s}{'steps':>7s}{'sim t':>8s}{'wall s':>8s}{'| final:':>9s}{'loss':>7s}{'sim t':>8s}"
          f"{'wall s':>8s}{metric:>10s}")
    print(f"{'':16s}{'--- to target ---':>23s}{'|':>2s}")
    for r in rows:
        reached = r["steps_to_target"] is not None
        to_target = (f"{r['steps_to_target']:7d}{r['sim_time_to_target']:8.1f}{r['wall_to_target']:8.2f}"
                     if reached else f"{'never':>7s}{'-':>8s}{'-':>8s}")
        value = r["test_accuracy"] if task == "mlp" else r["val_loss"]
        print(f"{r['strategy']:16s}{to_target}{'|':>2s}{'':7s}{r['final_smoothed_loss']:7.3f}{r['final_sim_time']:8.1f}"
              f"{r['wall_seconds']:8.2f}{value:10.4f}")
    print(f"to target: the first step whose {SMOOTH}-step mean training loss is <= {target:.3f}, the simulated clock "
          f"and training wall seconds then; final: {SMOOTH}-step mean loss, simulated clock and wall seconds after "
          f"{steps} steps, {metric} held out (local SGD / DiLoCo: of the anchor)")


if __name__ == "__main__":
    main()
