"""Pipeline schedules over a stage axis: GPipe and memory-bounded 1F1B, as functions run inside a `jax.shard_map`
that is manual over that axis (each device holds one stage's layers and runs them on one microbatch per tick).

A pipelined model is `stage_fn(stage_params, x) -> y` with `y` shaped like `x` (a stack of identical residual
blocks, a stage being a contiguous run of them), microbatches `xs` of shape `[M, ...]`, and S stages along `axis`.
Activations move to the next stage and cotangents to the previous one with `lax.ppermute` after every tick.

- `gpipe(stage_fn, params, xs, axis=...)`: every microbatch forward through all stages in M + S - 1 ticks (a
  `lax.scan`); the backward is autodiff through that scan. `stage_fn` is rematerialised, so each tick keeps only
  its stage input for the backward: activation memory grows with M.
- `one_f_one_b(stage_fn, loss_fn, params, xs, targets, axis=...)`: a hand-written backward. Stage s runs a
  forward on ticks where t + s is even and a backward on the others, so in the steady state every stage alternates
  one forward and one backward (1F1B) and nothing waits: 2(M + S - 1) ticks of one half-step each, the same time as
  GPipe's M + S - 1 forward and M + S - 1 backward ticks, and the same bubble (S - 1) / (M + S - 1). A microbatch's
  input stays stashed on a stage from its forward to its backward: at most S of them at once on stage 0, fewer
  further on (the stash is `[S, ...]` whatever M), and the backward recomputes the stage forward from it with
  `jax.vjp`. Parameter gradients accumulate across ticks.

Both are checked against the sequential model (loss and every gradient) in tests/test_pipeline.py.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

StageFn = Callable[[object, jax.Array], jax.Array]


def _to_next(x, axis: str, stages: int):
    """Each stage's `x` to the next stage (the last sends nothing; stage 0 receives zeros)."""
    return lax.ppermute(x, axis, [(i, i + 1) for i in range(stages - 1)])


def _to_previous(x, axis: str, stages: int):
    """Each stage's `x` to the previous stage (stage 0 sends nothing; the last receives zeros)."""
    return lax.ppermute(x, axis, [(i + 1, i) for i in range(stages - 1)])


def _pick(pred, new, old):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def gpipe(stage_fn: StageFn, params, xs: jax.Array, *, axis: str) -> jax.Array:
    """The last stage's output for every microbatch, `[M, ...]` (valid on the last stage, zeros elsewhere).

    Differentiate a loss of it (masked to the last stage and summed over `axis`) for the backward: it runs the
    ticks in reverse, recomputing each stage forward from its saved input."""
    stages, stage = lax.axis_size(axis), lax.axis_index(axis)
    count = xs.shape[0]
    body = jax.checkpoint(stage_fn)  # the backward keeps each tick's stage input only

    def tick(received, t):
        x = jnp.where(stage == 0, xs[jnp.clip(t, 0, count - 1)], received)
        y = body(params, x)
        return _to_next(y, axis, stages), y

    _, ys = lax.scan(tick, jnp.zeros_like(xs[0]), jnp.arange(count + stages - 1))
    # microbatch m leaves the last stage at tick m + S - 1
    return jnp.where(stage == stages - 1, ys[stages - 1:], jnp.zeros_like(xs))


def one_f_one_b(stage_fn: StageFn, loss_fn: Callable[[jax.Array, jax.Array], jax.Array], params, xs: jax.Array,
                targets, *, axis: str):
    """(mean over microbatches of `loss_fn(last stage output, target)`, the gradient of that mean with respect to
    this stage's `params`, its gradient with respect to `xs` (on stage 0; zeros elsewhere)).

    The loss is the same on every stage (summed over `axis` from the last); `targets` is `[M, ...]` (read on the
    last stage)."""
    stages, stage = lax.axis_size(axis), lax.axis_index(axis)
    count = xs.shape[0]
    last = stage == stages - 1
    zeros = jnp.zeros_like(xs[0])

    def forward(carry, m, valid):
        received, _, pending, stash, grads, input_grads, loss = carry
        x = jnp.where(stage == 0, xs[m], received)
        y = stage_fn(params, x)

        def head(y):  # the loss and its cotangent, on the last stage only
            value, cotangent = jax.value_and_grad(loss_fn)(y, jax.tree.map(lambda a: a[m], targets))
            return value, cotangent / count

        value, cotangent = lax.cond(last, head, lambda y: (jnp.zeros((), y.dtype), jnp.zeros_like(y)), y)
        stash = jnp.where(valid, stash.at[m % stages].set(x), stash)
        pending = jnp.where(valid & last, cotangent, pending)
        loss = loss + jnp.where(valid & last, value, 0.0)
        return y, zeros, (pending, stash, grads, input_grads, loss)

    def backward(carry, m, valid):
        _, received, pending, stash, grads, input_grads, loss = carry
        cotangent = jnp.where(last, pending, received)
        _, pull = jax.vjp(stage_fn, params, stash[m % stages])
        param_grads, x_grad = pull(cotangent)
        grads = _pick(valid, jax.tree.map(jnp.add, grads, param_grads), grads)
        input_grads = jnp.where(valid & (stage == 0), input_grads.at[m].set(x_grad), input_grads)
        return zeros, x_grad, (pending, stash, grads, input_grads, loss)

    def tick(carry, t):
        forward_tick = (t + stage) % 2 == 0
        m_forward = (t - stage) // 2  # stage s runs microbatch m forward at tick 2m + s
        m_backward = (t + stage + 1) // 2 - stages  # and backward at tick 2m + 2S - 1 - s
        m = jnp.where(forward_tick, m_forward, m_backward)
        valid = (m >= 0) & (m < count)
        m = jnp.clip(m, 0, count - 1)
        to_next, to_previous, kept = lax.cond(forward_tick, forward, backward, carry, m, valid)
        return (_to_next(to_next, axis, stages), _to_previous(to_previous, axis, stages)) + kept, None

    start = (zeros, zeros, zeros, jnp.zeros((stages,) + xs.shape[1:], xs.dtype),
             jax.tree.map(jnp.zeros_like, params), jnp.zeros_like(xs), jnp.zeros((), jnp.float32))
    carry, _ = lax.scan(tick, start, jnp.arange(2 * (count + stages - 1)))
    *_, grads, input_grads, loss = carry
    return lax.psum(loss, axis) / count, grads, input_grads
