"""Pipeline schedules over a stage axis: GPipe, circular and memory-bounded 1F1B, as functions run inside a
`jax.shard_map` that is manual over that axis (each device holds one stage's layers and runs them on one microbatch
per tick).

A pipelined model is `stage_fn(stage_params, x, m) -> y` with `y` shaped like `x` (a stack of identical residual
blocks, a stage being a contiguous run of them; `m` is the microbatch index, for dropout keys), microbatches `xs`
of shape `[M, ...]`, and S stages along `axis`. Activations move to the next stage and cotangents to the previous
one with `lax.ppermute` after every tick.

- `gpipe(stage_fn, params, xs, axis=...)`: every microbatch forward through all stages in M + S - 1 ticks (a
  `lax.scan`); the backward is autodiff through that scan. `stage_fn` is rematerialised, so each tick keeps only
  its stage input for the backward: activation memory grows with M. Bubble (S - 1) / (M + S - 1).
- `circular(stage_fn, params, xs, axis=..., repeats=R)`: each stage holds R chunks of layers (`params` has a
  leading R dimension; chunk r of stage s is the (r * S + s)-th run of layers), and every microbatch goes round the
  ring of stages R times: R * M + S - 1 ticks of one chunk each, bubble (S - 1) / (R * M + S - 1). The last stage
  sends to stage 0, which keeps the returning activations until their next round (M >= S is needed so a round is
  back before it is due). `gpipe` is `circular` with R = 1.
- `one_f_one_b` (`jaxpar.pipeline.one_f_one_b`): 1F1B, a hand-written backward; it uses the helpers here.

All three are checked against the sequential model (loss and every gradient) in tests/pipeline/test_pipeline.py.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

StageFn = Callable[[object, jax.Array, jax.Array], jax.Array]
# the name scope of 1F1B's half-step conditional, whose branches (a forward, a backward) every stage runs in turn:
# the FLOP count (`jaxpar.cost.hlo.flops`) counts their mean per half-step, not the dearer one
ALTERNATING = "jaxpar_alternating"
# the name scope of a conditional whose true branch (the head, the part before the stack) the busiest device takes
# in `runs` of the `reached` times it reaches it (the other times are bubble ticks): the FLOP count weighs the
# branches so, not the dearer one every time
TAKEN = "jaxpar_taken"


def taken(runs: int, reached: int):
    """The name scope of such a conditional (see TAKEN)."""
    return jax.named_scope(f"{TAKEN}_{runs}_of_{reached}")


def _to_next(x, axis: str, stages: int, ring: bool = False):
    """Each stage's `x` to the next stage (the last sends to stage 0 when `ring`, else nothing; then stage 0
    receives zeros)."""
    pairs = [(i, (i + 1) % stages) for i in range(stages if ring else stages - 1)]
    return lax.ppermute(x, axis, pairs)


def pick(pred, new, old):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def branch(uniform: bool, pred, true_fn, false_fn, *args):
    """`lax.cond(pred, true_fn, false_fn, *args)`, or when `uniform` both branches run and `pred` picks: every
    device then runs the same collectives in the same order. A collective over another axis inside a branch that
    only some stages take (a seq axis's permutes, in the stack's attention or the sequence shift of the part before
    it) waits for devices that never reach it: XLA's collective-permute joins every device of the program."""
    if not uniform:
        return lax.cond(pred, true_fn, false_fn, *args)
    return pick(pred, true_fn(*args), false_fn(*args))


def gpipe(stage_fn: StageFn, params, xs: jax.Array, *, axis: str) -> jax.Array:
    """The last stage's output for every microbatch, `[M, ...]` (valid on the last stage, zeros elsewhere).

    Differentiate a loss of it (masked to the last stage and summed over `axis`) for the backward: it runs the
    ticks in reverse, recomputing each stage forward from its saved input."""
    return circular(lambda p, x, m, r: stage_fn(p, x, m), jax.tree.map(lambda a: a[None], params), xs, axis=axis,
                    repeats=1)


def circular(stage_fn: Callable, params, xs: jax.Array, *, axis: str, repeats: int) -> jax.Array:
    """`gpipe` with `repeats` chunks of layers per stage: `params` has a leading `repeats` dimension and
    `stage_fn(chunk_params, x, m, r)` runs chunk r. Needs M >= S when repeats > 1."""
    stages, stage = lax.axis_size(axis), lax.axis_index(axis)
    count = xs.shape[0]
    if repeats > 1 and count < stages:
        raise ValueError(f"the circular schedule needs at least as many microbatches as stages ({count} < {stages})")
    items = repeats * count
    # The chunk is picked inside the rematerialised body: picked outside, each tick's slice of the parameters would
    # be a residual of the scan, a copy of the stage's parameters saved per tick. Inside, the residuals are the
    # loop-invariant parameters (saved once) and each tick's stage input.
    body = jax.checkpoint(lambda p, x, m, r: stage_fn(jax.tree.map(lambda a: a[r], p), x, m, r))

    def tick(carry, t):
        received, returned = carry  # returned: stage 0's activations back from the last stage, by microbatch
        i = jnp.clip(t - stage, 0, items - 1)  # the (round, microbatch) item this stage runs
        r, m = i // count, i % count
        if repeats > 1:
            first = jnp.where(r == 0, xs[m], returned[m])
        else:
            first = xs[m]
        x = jnp.where(stage == 0, first, received)
        y = body(params, x, m, r)
        sent = _to_next(y, axis, stages, ring=repeats > 1)
        if repeats > 1:  # on stage 0, `sent` is the last stage's output of item t - S + 1: keep it for its next round
            back = t - stages + 1
            keep = (stage == 0) & (back >= 0) & (back < items - count)
            returned = jnp.where(keep, returned.at[jnp.clip(back, 0, items - 1) % count].set(sent), returned)
        return (sent, returned), y

    returned = jnp.zeros_like(xs) if repeats > 1 else jnp.zeros((), xs.dtype)
    _, ys = lax.scan(tick, (jnp.zeros_like(xs[0]), returned), jnp.arange(items + stages - 1))
    # microbatch m leaves the last stage, in its last round, at tick (R - 1) M + m + S - 1
    return jnp.where(stage == stages - 1, ys[items - count + stages - 1:], jnp.zeros_like(xs))


def circular_loss(stage_fn: Callable, first_fn: Callable, head_fn: Callable, params, head_params, count: int, *,
                  axis: str, repeats: int = 1):
    """GPipe (`repeats` 1) or circular with the rest of the model inside the ticks: stage 0 computes microbatch m's
    stack input `first_fn(head_params, m)` in the tick that runs it, and the last stage applies
    `head_fn(head_params, y, m) -> (loss, metrics)` to each microbatch's output in the tick it leaves. Returns this
    stage's (sum of its microbatches' losses, sums of their metrics, in float32): the last stage's, zeros elsewhere.

    Differentiate it for the backward (the ticks in reverse). Each tick is rematerialised as a whole, so it keeps
    one activation (its received input) for the backward and recomputes the rest; only one microbatch's head runs
    at a time."""
    stages, stage = lax.axis_size(axis), lax.axis_index(axis)
    if repeats > 1 and count < stages:
        raise ValueError(f"the circular schedule needs at least as many microbatches as stages ({count} < {stages})")
    items = repeats * count
    like = jax.eval_shape(first_fn, head_params, 0)
    zeros = jnp.zeros(like.shape, like.dtype)
    shapes = jax.eval_shape(head_fn, head_params, zeros, 0)
    no_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes[1])

    @jax.checkpoint
    def run(p, h, x_in, m, r, starts, ends):
        with taken(count, items + stages - 1):  # stage 0 embeds, the last stage runs the head, M ticks of them all
            x = lax.cond(starts, lambda: first_fn(h, m).astype(like.dtype), lambda: x_in)
        y = stage_fn(jax.tree.map(lambda a: a[r], p), x, m, r)

        def head():
            value, aux = head_fn(h, y, m)
            return value.astype(jnp.float32), jax.tree.map(lambda a: a.astype(jnp.float32), aux)

        with taken(count, items + stages - 1):
            value, aux = lax.cond(ends, head, lambda: (jnp.zeros((), jnp.float32), no_metrics))
        return y, value, aux

    def tick(carry, t):
        received, returned, loss, metrics = carry
        raw = t - stage  # the (round, microbatch) item this stage runs, when in range
        i = jnp.clip(raw, 0, items - 1)
        r, m = i // count, i % count
        x_in = jnp.where(stage == 0, returned[m], received) if repeats > 1 else received
        ends = (stage == stages - 1) & (raw >= items - count) & (raw < items)
        y, value, aux = run(params, head_params, x_in, m, r, (stage == 0) & (raw < count), ends)
        sent = _to_next(y, axis, stages, ring=repeats > 1)
        if repeats > 1:  # on stage 0, `sent` is the last stage's output of item t - S + 1: keep it for its next round
            back = t - stages + 1
            keep = (stage == 0) & (back >= 0) & (back < items - count)
            returned = jnp.where(keep, returned.at[jnp.clip(back, 0, items - 1) % count].set(sent), returned)
        return (sent, returned, loss + value, jax.tree.map(jnp.add, metrics, aux)), None

    returned = jnp.zeros((count,) + like.shape, like.dtype) if repeats > 1 else jnp.zeros((), like.dtype)
    start = (zeros, returned, jnp.zeros((), jnp.float32), no_metrics)
    (_, _, loss, metrics), _ = lax.scan(tick, start, jnp.arange(items + stages - 1))
    return loss, metrics
