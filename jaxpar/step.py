"""The pure pieces a training step is made of; strategies compose them.

A model lives in the train state as two `nnx.State`s: `params` (the `nnx.Param`s the optimizer updates) and
`model_state` (everything else: BatchNorm statistics, dropout RNG counters). A `graphdef` (static structure, in
train or eval mode) turns them back into a module inside the jitted step.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

LossFn = Callable[[nnx.Module, dict], "tuple[jax.Array, dict[str, jax.Array]]"]


class TrainState(NamedTuple):
    """Everything that changes during training; a pytree, so it can be jitted, sharded and checkpointed."""

    step: jax.Array  # int32 scalar: number of updates applied
    params: Any  # nnx.State of the model's nnx.Param variables
    model_state: Any  # nnx.State of its other variables (BatchNorm statistics, RNG counters)
    opt_state: Any  # optax state, sharded like params
    strategy_state: Any = ()  # extra state a strategy keeps (per-replica parameters, stale versions, ...)


def split_model(model: nnx.Module):
    """(graphdef, params, model_state): the one place that decides what the optimizer trains."""
    return nnx.split(model, nnx.Param, ...)


def loss_and_grad(graphdef, loss_fn: LossFn, params, model_state, batch, accum: int = 1):
    """Returns (loss, metrics, new model_state, grads) of `loss_fn(model, batch)` with respect to params.

    accum > 1: gradient accumulation over `accum` equal microbatches (scanned, so activations of one microbatch are
    alive at a time); for a mean loss the result equals the full batch's. Microbatch m takes rows m, m + accum, ...,
    so every microbatch keeps its share of every data shard and nothing moves between devices.
    """
    if accum > 1:
        return _accumulated(graphdef, loss_fn, params, model_state, batch, accum)

    model = nnx.merge(graphdef, params, model_state)
    # nnx.value_and_grad (not jax's) lets the model update its own non-parameter state (RNG counters,
    # BatchNorm statistics) under differentiation; gradients are taken with respect to nnx.Param only.
    (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    new_model_state = split_model(model)[2]
    return loss, metrics, new_model_state, grads


def apply_gradients(tx: optax.GradientTransformation, params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def evaluate_batch(graphdef, loss_fn: LossFn, params, model_state, batch):
    model = nnx.merge(graphdef, params, model_state)
    loss, metrics = loss_fn(model, batch)
    return {"loss": loss, **metrics}


def _accumulated(graphdef, loss_fn, params, model_state, batch, accum):
    micro = jax.tree.map(lambda x: x.reshape((x.shape[0] // accum, accum) + x.shape[1:]).swapaxes(0, 1), batch)

    def one(carry, microbatch):  # params ride in the carry: NNX modules may only be built at their own trace level
        grads_sum, p, state = carry
        loss, metrics, state, grads = loss_and_grad(graphdef, loss_fn, p, state, microbatch)
        return (jax.tree.map(jnp.add, grads_sum, grads), p, state), (loss, metrics)

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads_sum, _, model_state), (losses, metrics) = jax.lax.scan(one, (zeros, params, model_state), micro)
    mean = functools.partial(jnp.mean, axis=0)
    return mean(losses), jax.tree.map(mean, metrics), model_state, jax.tree.map(lambda g: g / accum, grads_sum)
