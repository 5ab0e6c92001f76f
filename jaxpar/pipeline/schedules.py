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
- `one_f_one_b(stage_fn, head_fn, params, head_params, xs, axis=...)`: a hand-written backward. A tick is two
  half-steps; in half-step h (0 to 2(M + S - 1) - 1) stage s runs a forward when h + s is even and a backward
  otherwise, so in the steady state every stage does one forward and one backward per tick (1F1B) and nothing
  waits: M + S - 1 ticks, the same time as GPipe's M + S - 1 forward and M + S - 1 backward ticks, and the same
  bubble (S - 1) / (M + S - 1). After each half-step every stage sends one array: its activation to the next stage
  after a forward, its cotangent to the previous one after a backward, in one `ppermute` whose pairs follow the
  half-step's parity (2 A per tick from a middle stage, as GPipe's forward and backward ticks). A microbatch's
  input stays stashed on a stage from its forward to its backward: at most S of them at once on stage 0, fewer
  further on (the stash is `[S, ...]` whatever M), and the backward recomputes the stage forward from it with
  `jax.vjp`. Parameter gradients accumulate across ticks. The last stage applies `head_fn` (the rest of the model
  and the loss) to each microbatch as it leaves, so its backward can start at once.

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


def _alternating_pairs(stages: int, parity: int) -> list[tuple[int, int]]:
    """1F1B's sends after a half-step of `parity`: a stage that ran a forward (s + parity even) to the next stage,
    one that ran a backward to the previous one; every stage receives from at most one neighbour."""
    pairs = []
    for s in range(stages):
        target = s + 1 if (s + parity) % 2 == 0 else s - 1
        if 0 <= target < stages:
            pairs.append((s, target))
    return pairs


def reads(fn, params) -> list[bool]:
    """For each leaf of `params`, whether `fn(params)` depends on it at all (a leaf it never reads has a zero
    gradient: 1F1B's head does not read the layers before the stack, and summing their zeros over the devices is
    waste; a block with dropout 0 does not read its key)."""
    jaxpr = jax.make_jaxpr(fn)(params).jaxpr
    live = {id(v) for v in jaxpr.outvars}
    for eqn in reversed(jaxpr.eqns):  # what the result depends on (the head's trace holds dead code: the part
        if eqn.effects or any(id(v) in live for v in eqn.outvars):  # before the stack, whose output is replaced)
            live.update(id(v) for v in eqn.invars)
    return [id(v) in live for v in jaxpr.invars]


def _pick(pred, new, old):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def _branch(uniform: bool, pred, true_fn, false_fn, *args):
    """`lax.cond(pred, true_fn, false_fn, *args)`, or when `uniform` both branches run and `pred` picks: every
    device then runs the same collectives in the same order. A collective over another axis inside a branch that
    only some stages take (a seq axis's permutes, in the stack's attention or the sequence shift of the part before
    it) waits for devices that never reach it: XLA's collective-permute joins every device of the program."""
    if not uniform:
        return lax.cond(pred, true_fn, false_fn, *args)
    return _pick(pred, true_fn(*args), false_fn(*args))


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


def one_f_one_b(stage_fn: StageFn, head_fn: Callable, params, head_params, xs, *, axis: str,
                rows_axis: str | None = None, count: int | None = None, uniform: bool = False):
    """(mean over microbatches of the loss, mean of the metrics, the gradient of that mean loss with respect to
    this stage's `params`, with respect to `head_params`, and with respect to `xs`).

    `head_fn(head_params, y, m) -> (loss, metrics)` is the rest of the model and the loss on microbatch m's last
    stage output `y`. Loss, metrics, head gradients and input gradients are the same on every stage (summed over
    `axis` from the one stage that computes each).

    `rows_axis`: a data axis the caller's map is also manual over, each shard holding its own rows of every
    microbatch. The loss is then the mean of the shards' losses (a mean over examples, equal shards), and every
    gradient is accumulated locally over the ticks and summed over `rows_axis` once, after the loop.

    `xs` may instead be a function `first(head_params, m) -> x` (the part of the model before the stack on
    microbatch m) with `count` microbatches: stage 0 then runs it in its forward half-step and pulls its backward's
    input gradient through it at once, adding to the gradients with respect to `head_params`; nothing of the size
    of M microbatches is kept, and the gradient with respect to `xs` is returned as None.

    `uniform`: every stage runs both sides of each choice (forward and backward of a half-step, the head, the part
    before the stack) and keeps the one its schedule picks (`_branch`), for stage functions with collectives over
    another axis; a half-step then costs a forward and a backward, as a tick of GPipe's lockstep does."""
    stages, stage = lax.axis_size(axis), lax.axis_index(axis)
    shards = 1 if rows_axis is None else lax.axis_size(rows_axis)
    first = xs if callable(xs) else None
    count = count if first else xs.shape[0]
    like = jax.eval_shape(first, head_params, 0) if first else xs[0]
    last = stage == stages - 1
    zeros = jnp.zeros(like.shape, like.dtype)
    shapes = jax.eval_shape(head_fn, head_params, zeros, 0)
    no_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes[1])

    def forward(carry, m, valid):
        received, pending, stash, grads, head_grads, input_grads, loss, metrics = carry
        if first:
            with taken(count, count + stages - 1):  # M of a stage's M + S - 1 forward half-steps
                x = _branch(uniform, (stage == 0) & valid, lambda: first(head_params, m).astype(zeros.dtype),
                            lambda: received)
        else:
            x = jnp.where(stage == 0, xs[m], received)
        y = stage_fn(params, x, m)

        def head(y):  # the loss, its cotangent and the head's gradients, on the last stage only
            (value, aux), (g_head, g_y) = jax.value_and_grad(head_fn, argnums=(0, 1), has_aux=True)(head_params, y, m)
            aux = jax.tree.map(lambda a: a.astype(jnp.float32), aux)
            scale = count * shards  # d(mean over microbatches and shards) / d(this shard's microbatch loss)
            return value.astype(jnp.float32), aux, jax.tree.map(lambda g: g / scale, g_head), g_y / scale

        def idle(y):
            return (jnp.zeros((), jnp.float32), no_metrics, jax.tree.map(jnp.zeros_like, head_params),
                    jnp.zeros_like(y))

        with taken(count, count + stages - 1):  # (bubble half-steps: idle)
            value, aux, g_head, cotangent = _branch(uniform, last & valid, head, idle, y)
        use = valid & last
        stash = jnp.where(valid, stash.at[m % stages].set(x), stash)
        pending = jnp.where(use, cotangent, pending)
        head_grads = _pick(use, jax.tree.map(jnp.add, head_grads, g_head), head_grads)
        loss = loss + jnp.where(use, value, 0.0)
        metrics = jax.tree.map(lambda a, b: a + jnp.where(use, b, 0.0), metrics, aux)
        return y, (pending, stash, grads, head_grads, input_grads, loss, metrics)

    def backward(carry, m, valid):
        received, pending, stash, grads, head_grads, input_grads, loss, metrics = carry
        cotangent = jnp.where(last, pending, received)
        _, pull = jax.vjp(lambda p, x: stage_fn(p, x, m), params, stash[m % stages])
        param_grads, x_grad = pull(cotangent)
        grads = _pick(valid, jax.tree.map(jnp.add, grads, param_grads), grads)
        if first:  # stage 0: the part before the stack's gradients, from this microbatch's input gradient
            def pull_first():
                _, pull_x = jax.vjp(lambda h: first(h, m).astype(zeros.dtype), head_params)
                return pull_x(x_grad)[0]

            with taken(count, count + stages - 1):
                g_first = _branch(uniform, (stage == 0) & valid, pull_first,
                                  lambda: jax.tree.map(jnp.zeros_like, head_params))
            head_grads = _pick(valid & (stage == 0), jax.tree.map(jnp.add, head_grads, g_first), head_grads)
        else:
            input_grads = jnp.where(valid & (stage == 0), input_grads.at[m].set(x_grad), input_grads)
        return x_grad, (pending, stash, grads, head_grads, input_grads, loss, metrics)

    def half_step(carry, h, parity: int):
        """Half-step h (of parity `parity`, known when tracing so the send's pairs are static)."""
        forward_tick = (h + stage) % 2 == 0
        m_forward = (h - stage) // 2  # stage s runs microbatch m forward at half-step 2m + s
        m_backward = (h + stage + 1) // 2 - stages  # and backward at half-step 2m + 2S - 1 - s
        m = jnp.where(forward_tick, m_forward, m_backward)
        valid = (m >= 0) & (m < count)
        m = jnp.clip(m, 0, count - 1)
        with jax.named_scope(ALTERNATING):  # the cost analysis counts the mean of these branches
            sent, kept = _branch(uniform, forward_tick, forward, backward, carry, m, valid)
        # what a stage receives is what it needs next: after a forward half-step its left neighbour's activation
        # (it runs a forward next), after a backward its right neighbour's cotangent
        pairs = _alternating_pairs(stages, parity)  # none after odd half-steps with 2 stages: nothing is sent
        return (lax.ppermute(sent, axis, pairs) if pairs else jnp.zeros_like(sent),) + kept

    def tick(carry, t):
        return half_step(half_step(carry, 2 * t, 0), 2 * t + 1, 1), None

    start = (zeros, zeros, jnp.zeros((stages,) + like.shape, like.dtype),
             jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, head_params),
             jnp.zeros((), like.dtype) if first else jnp.zeros_like(xs), jnp.zeros((), jnp.float32), no_metrics)
    carry, _ = lax.scan(tick, start, jnp.arange(count + stages - 1))
    *_, grads, head_grads, input_grads, loss, metrics = carry
    # only the gradients the head (or the part before the stack) reads are summed; the others are zeros everywhere
    read = reads(lambda p: head_fn(p, zeros, 0)[0], head_params)
    if first:
        read = [a or b for a, b in zip(read, reads(lambda p: first(p, 0), head_params))]
        input_grads = None
    head_leaves, head_tree = jax.tree.flatten(head_grads)
    summed = [g for g, r in zip(head_leaves, read) if r]
    loss, metrics, summed, input_grads = lax.psum(
        (loss / count, jax.tree.map(lambda a: a / count, metrics), summed, input_grads), axis)
    if rows_axis is not None:  # the gradient average over data: one psum, once per step
        loss, metrics, summed, grads = lax.psum(
            (loss / shards, jax.tree.map(lambda a: a / shards, metrics), summed, grads), rows_axis)
    summed = iter(summed)
    head_grads = head_tree.unflatten([next(summed) if r else g for g, r in zip(head_leaves, read)])
    return loss, metrics, grads, head_grads, input_grads
