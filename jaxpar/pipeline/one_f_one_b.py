"""1F1B over a stage axis, run inside a `jax.shard_map` manual over it (see `jaxpar.pipeline.schedules` for the
shape of a pipelined model and the other schedules):

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

Checked against the sequential model (loss and every gradient) in tests/pipeline/test_pipeline.py.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.pipeline.schedules import ALTERNATING, StageFn, branch, pick, taken


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
    before the stack) and keeps the one its schedule picks (`branch`), for stage functions with collectives over
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
                x = branch(uniform, (stage == 0) & valid, lambda: first(head_params, m).astype(zeros.dtype),
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
            value, aux, g_head, cotangent = branch(uniform, last & valid, head, idle, y)
        use = valid & last
        stash = jnp.where(valid, stash.at[m % stages].set(x), stash)
        pending = jnp.where(use, cotangent, pending)
        head_grads = pick(use, jax.tree.map(jnp.add, head_grads, g_head), head_grads)
        loss = loss + jnp.where(use, value, 0.0)
        metrics = jax.tree.map(lambda a, b: a + jnp.where(use, b, 0.0), metrics, aux)
        return y, (pending, stash, grads, head_grads, input_grads, loss, metrics)

    def backward(carry, m, valid):
        received, pending, stash, grads, head_grads, input_grads, loss, metrics = carry
        cotangent = jnp.where(last, pending, received)
        _, pull = jax.vjp(lambda p, x: stage_fn(p, x, m), params, stash[m % stages])
        param_grads, x_grad = pull(cotangent)
        grads = pick(valid, jax.tree.map(jnp.add, grads, param_grads), grads)
        if first:  # stage 0: the part before the stack's gradients, from this microbatch's input gradient
            def pull_first():
                _, pull_x = jax.vjp(lambda h: first(h, m).astype(zeros.dtype), head_params)
                return pull_x(x_grad)[0]

            with taken(count, count + stages - 1):
                g_first = branch(uniform, (stage == 0) & valid, pull_first,
                                  lambda: jax.tree.map(jnp.zeros_like, head_params))
            head_grads = pick(valid & (stage == 0), jax.tree.map(jnp.add, head_grads, g_first), head_grads)
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
            sent, kept = branch(uniform, forward_tick, forward, backward, carry, m, valid)
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
