"""jaxpar's train step against a hand-written `jax.jit` step with `NamedSharding`, same model, mesh and batch.

    python -m benchmarks.overhead --mesh 2x4 --rounds 5 --steps 20
    python -m benchmarks.overhead --model mlp --mesh 2x4 --fit    # jaxpar through Trainer.fit's loop

Runs alternate (trainer, hand-written, trainer, ...) in one process so machine noise hits both alike; prints the
median steps/s of each and their ratio (>= 0.95 means jaxpar adds at most 5% per step). The trainer's step includes
the non-finite-step guard (`skip_nonfinite`, which the hand-written step lacks) unless --no-skip. With --fit,
jaxpar's rounds run through `Trainer.fit` (its loop, the readiness polls of `wait_ready`, metrics read to the host
each step) against the hand-written step's plain loop (waits on the step before the last, as fit does).
"""

import argparse
import functools
import itertools
import json
import statistics

import jaxpar
from benchmarks import common


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--model", default="transformer", choices=["transformer", "mlp", "cnn"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-skip", action="store_true",
                        help="Trainer(skip_nonfinite=False), the CLI's --on-nonfinite abort: flag a non-finite step "
                             "instead of skipping it (skip is the default)")
    parser.add_argument("--fit", action="store_true",
                        help="run jaxpar's rounds through Trainer.fit instead of a loop of trainer.step calls")
    parser.add_argument("--hlo", action="store_true",
                        help="compare the two compiled steps (collectives, entry ops, FLOPs, bytes, memory) and exit")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the timed rounds, cProfile this many trainer steps and print the host time per "
                             "step of the functions that take the most")
    args = parser.parse_args()
    mesh = jaxpar.make_mesh(args.mesh)  # before anything touches JAX: provides the CPU devices

    import jax
    import optax
    from flax import nnx

    from jaxpar.parallel import partitioning as sharding

    parts = common.setup(args.model, dropout=0.0, batch_size=args.batch_size)
    factory, loss_fn, batch, tx = parts.factory, parts.loss_fn, parts.batch, optax.adamw(1e-3)
    trainer = common.trainer(parts, mesh, tx, skip_nonfinite=not args.no_skip)
    trainer_batch = trainer.shard_batch(batch)

    # The hand-written baseline: what a JAX user writes without jaxpar.
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
    abstract.train()
    graphdef, abs_params, abs_rest = nnx.split(abstract, nnx.Param, ...)
    p_sh = sharding.state_shardings(abs_params, jaxpar.DEFAULT_RULES, mesh)
    rest_sh = sharding.state_shardings(abs_rest, jaxpar.DEFAULT_RULES, mesh)
    o_sh = sharding.optimizer_shardings(tx, jax.eval_shape(tx.init, abs_params), p_sh, mesh)
    b_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    def init():
        with nnx.use_eager_sharding(False):
            _, params, rest = nnx.split(factory(nnx.Rngs(0)), nnx.Param, ...)
        return params, rest, tx.init(params)

    params, rest, opt_state = jax.jit(init, out_shardings=(p_sh, rest_sh, o_sh))()

    def hand_step(params, opt_state, rest, batch):
        # What an NNX user writes: merge, differentiate w.r.t. Params (BatchNorm/RNG state may change), update.
        model = nnx.merge(graphdef, params, rest)
        (value, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        rest = nnx.split(model, nnx.Param, ...)[2]
        return optax.apply_updates(params, updates), opt_state, rest, {"loss": value, **metrics}

    hand = jax.jit(hand_step, in_shardings=(p_sh, o_sh, rest_sh, b_sh), out_shardings=(p_sh, o_sh, rest_sh, None),
                   donate_argnums=(0, 1, 2))
    hand_batch = jax.device_put(batch, b_sh)

    if args.hlo:
        compare_compiled({"jaxpar": trainer.compiled_step("sync", trainer_batch),
                          "hand_jit": hand.lower(params, opt_state, rest, hand_batch).compile()}, mesh)
        return
    state = trainer.init(0)

    def trainer_step():
        nonlocal state
        state, metrics = trainer.step(state, trainer_batch)
        return metrics

    def hand_jit_step():
        nonlocal params, opt_state, rest
        params, opt_state, rest, metrics = hand(params, opt_state, rest, hand_batch)
        return metrics

    def fit_steps(n):
        nonlocal state
        state = trainer.fit(state, itertools.repeat(trainer_batch), n)

    runners = {"jaxpar": fit_steps if args.fit else functools.partial(common.run_steps, trainer_step),
               "hand_jit": functools.partial(common.run_steps, hand_jit_step)}
    rates = common.alternating_rates(runners, args.rounds, args.steps, runs=True)
    result = {"mesh": args.mesh, "model": args.model, "batch_size": args.batch_size, "skip_nonfinite": not args.no_skip,
              "fit": args.fit,
              "jaxpar_steps_per_sec": statistics.median(rates["jaxpar"]),
              "hand_jit_steps_per_sec": statistics.median(rates["hand_jit"])}
    result["ratio"] = result["jaxpar_steps_per_sec"] / result["hand_jit_steps_per_sec"]
    # each round's ratio (the two ran back to back in it): the spread that machine noise leaves
    result["round_ratios"] = sorted(a / b for a, b in zip(rates["jaxpar"], rates["hand_jit"]))
    # best round of each: on a loaded machine the least disturbed estimate of what each step can do
    result["best_ratio"] = max(rates["jaxpar"]) / max(rates["hand_jit"])
    print(f"{'':10s}{'steps/s (median of ' + str(args.rounds) + ')':>28s}")
    print(f"{'jaxpar':10s}{result['jaxpar_steps_per_sec']:28.2f}")
    print(f"{'hand jit':10s}{result['hand_jit_steps_per_sec']:28.2f}")
    print(f"ratio jaxpar / hand-written: {result['ratio']:.3f} (per round: "
          f"{', '.join(f'{r:.3f}' for r in result['round_ratios'])}; best round / best round "
          f"{result['best_ratio']:.3f})")
    print(json.dumps(result))
    if args.profile:
        profile(runners["jaxpar"], args.profile)


def compare_compiled(compiled: dict, mesh):
    """What each compiled step does on a device: its collectives, the ops of its entry computation (a conditional's
    branches are separate computations), XLA's FLOPs and bytes accessed, and its memory."""
    import re
    from collections import Counter

    from jaxpar.cost.hlo import collective_ops

    for name, step in compiled.items():
        text = step.as_text()
        entry = text[text.index("ENTRY"):]
        ops = Counter(op for op in re.findall(r"= .*?\s([a-z][a-z0-9\-]*)\(", entry)
                      if op not in ("parameter", "get-tuple-element", "constant", "bitcast"))
        cost = step.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        memory = step.memory_analysis()
        print(f"{name}: collectives {[(op.kind, op.axes, op.bytes) for op in collective_ops(step, mesh)]}")
        print(f"  entry ops {dict(sorted(ops.items()))}; fusions in all computations {text.count(' fusion(')}")
        print(f"  flops {cost.get('flops'):,.0f}, bytes accessed {cost.get('bytes accessed'):,.0f}; arguments "
              f"{memory.argument_size_in_bytes:,}, outputs {memory.output_size_in_bytes:,}, temporaries "
              f"{memory.temp_size_in_bytes:,} bytes")


def profile(run, steps: int, top: int = 24):
    """The host side of `run(steps)` (jaxpar's steps as the timed rounds run them): microseconds per step of the
    functions with the most own time (the jitted call's C++ dispatch counts as its caller's own time)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run(steps)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    print(f"host time per step over {steps} steps (us): own, with callees; function")
    for (path, line, name), (_, calls, own, cumulative, _) in rows:
        print(f"{1e6 * own / steps:10.1f} {1e6 * cumulative / steps:10.1f}  {name} ({path.split('/')[-1]}:{line}, "
              f"{calls / steps:g} calls/step)")


def summarize(rows):
    """The key numbers of the suite's summary (`python -m benchmarks`) from this script's JSON rows."""
    r = rows[-1]
    return [f"jaxpar / hand-written jit **{r['ratio']:.3f}** ({r['jaxpar_steps_per_sec']:.2f} vs "
            f"{r['hand_jit_steps_per_sec']:.2f} steps/s; {r.get('model')} on `{r.get('mesh')}`)"]


if __name__ == "__main__":
    main()
