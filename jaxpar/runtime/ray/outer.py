"""The delayed Nesterov outer optimizer of asynchronous local SGD (Liu et al. 2024, "Asynchronous Local-SGD
Training for Language Modeling"): with changes arriving one worker at a time, a momentum updated on every arrival
over-weights stale directions; here the momentum is updated once every `delay` server updates, from the mean of the
changes buffered since, and in between each change is applied with the outer learning rate alone.

    jaxpar.DiLoCo(period=8, outer_optimizer=delayed_nesterov(0.7, 0.9, delay=2))   # on the ray runtime
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class DelayedNesterovState(NamedTuple):
    count: jax.Array
    momentum: optax.Updates
    buffer: optax.Updates


def delayed_nesterov(learning_rate: float, momentum: float = 0.9, delay: int = 1) -> optax.GradientTransformation:
    """Outer SGD whose Nesterov momentum moves every `delay` updates; delay 1 is Nesterov SGD."""

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return DelayedNesterovState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update(grads, state, params=None):
        count = state.count + 1
        buffer = jax.tree.map(jnp.add, state.buffer, grads)
        boundary = count % delay == 0
        moved = jax.tree.map(lambda m, b: momentum * m + b / delay, state.momentum, buffer)
        new_momentum = jax.tree.map(lambda m, n: jnp.where(boundary, n, m), state.momentum, moved)
        updates = jax.tree.map(lambda g, m: -learning_rate * jnp.where(boundary, g + momentum * m, g), grads,
                               new_momentum)
        buffer = jax.tree.map(lambda b: jnp.where(boundary, jnp.zeros_like(b), b), buffer)
        return updates, DelayedNesterovState(count, new_momentum, buffer)

    return optax.GradientTransformation(init, update)
