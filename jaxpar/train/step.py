"""The pure pieces a training step is made of; strategies compose them.

A model lives in the train state as two `nnx.State`s: `params` (the `nnx.Param`s the optimizer updates) and
`model_state` (everything else: BatchNorm statistics, dropout RNG counters). A `graphdef` (static structure, in
train or eval mode) turns them back into a module inside the jitted step.

Randomness at call time: a loss function may be `loss_fn(model, batch)` or `loss_fn(model, batch, rngs)`. In the
second form it gets an `nnx.Rngs` with a `dropout` stream (and a default stream) that is fresh every step: derived
from the run key in the train state and the step number, then from the microbatch index under gradient
accumulation and from the replica index under the explicit strategies. Flax's NNX lm1b example calls
`model(x, rngs=rngs)` this way.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.errors import ConfigError, ModelError, StateError
from jaxpar.pipeline import staged_loss
from jaxpar.pipeline.stack import splits_loss
from jaxpar.train.faults import flag_if_not_finite, keep_if_finite
from jaxpar.train.model_errors import call_user

LossFn = Callable[..., "tuple[jax.Array, dict[str, jax.Array]]"]

_EVAL_STREAM = 0x5EED  # folded into the step key for evaluation (the model is in eval mode, so rarely drawn from)


class TrainState(NamedTuple):
    """Everything that changes during training; a pytree, so it is jitted, donated, sharded and checkpointed as one."""

    step: jax.Array  # int32 scalar: number of updates applied
    params: Any  # nnx.State of the model's nnx.Param variables
    model_state: Any  # nnx.State of its other variables (BatchNorm statistics, RNG counters)
    opt_state: Any  # optax state, sharded like params
    strategy_state: Any = ()  # extra state a strategy keeps (per-replica parameters, stale versions, ...)
    key: Any = ()  # uint32 key data of the run's PRNG key (raw data, so checkpoints need no typed-key support)
    comm_state: Any = ()  # state of the averaging algorithm (e.g. error feedback of a compressed allreduce)


def check_state(state) -> None:
    """Refuses anything but a live `TrainState` (a donated one names the fix)."""
    if not isinstance(state, TrainState):
        raise StateError(f"state: got {type(state).__name__}; pass the TrainState from trainer.init or trainer.step")
    # `step` donates the whole state at once, so its step counter tells (a walk of the parameters would cost every
    # step)
    if isinstance(state.step, jax.Array) and state.step.is_deleted():
        raise StateError("state: its arrays were donated to an earlier call; `step` donates its state: use the state "
                         "it returned (state, metrics = trainer.step(state, batch))")


def split_model(model: nnx.Module):
    """(graphdef, params, model_state): the one place that decides what the optimizer trains."""
    return nnx.split(model, nnx.Param, ...)


def step_key(state: TrainState) -> jax.Array:
    """The typed key of the update `state.step`: fresh every step, the same on every mesh."""
    return jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)


def takes_rngs(loss_fn: Callable) -> bool:
    """True for `loss_fn(model, batch, rngs)`: a parameter named `rngs`, or three required positional ones."""
    try:
        parameters = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):
        return False
    if any(p.name == "rngs" for p in parameters):
        return True
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    return len(positional) >= 3


def with_rngs(loss_fn: LossFn) -> Callable:
    """`loss_fn` in the three-argument form `(model, batch, rngs)`, whichever form the user wrote."""
    if takes_rngs(loss_fn):
        return loss_fn
    return lambda model, batch, rngs: loss_fn(model, batch)


LOSS_CONTRACT = "loss_fn must be (model, batch[, rngs]) -> (scalar loss, dict of metrics)"


def _describe(value) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, (tuple, list)):
        return f"a {len(value)}-{type(value).__name__}"
    return f"a {type(value).__name__}"


def _is_numeric(value) -> bool:
    try:
        dtype = jnp.result_type(value)
    except TypeError:
        return False
    return jnp.issubdtype(dtype, jnp.number) or dtype == jnp.bool_


def _is_scalar(value) -> bool:
    return _is_numeric(value) and jnp.ndim(value) == 0


def call_loss(loss_fn, model, batch, rngs):
    """`loss_fn(model, batch, rngs)`, checked against the contract at trace time (no cost at run time).

    Raises `ModelError` naming what came back instead of `(scalar loss, dict of metrics)`. Metrics are numeric
    arrays; scalars are what `fit` logs (an array metric, e.g. per-example predictions, is returned by `step` and
    passed to actions as a numpy array, but not written to the JSONL). Anything else the loss or the model raises
    comes out as a `ModelCallError` (`jaxpar.train.model_errors`).
    """
    out = call_user(loss_fn, model, batch, rngs)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ModelError(f"{LOSS_CONTRACT}; it returned {_describe(out)}")
    loss, metrics = out
    if not (_is_scalar(loss) and jnp.issubdtype(jnp.result_type(loss), jnp.floating)):
        raise ModelError(f"{LOSS_CONTRACT}; its loss is {_describe(loss)} (reduce it to a float scalar, e.g. "
                         f".mean())")
    if not isinstance(metrics, Mapping):
        raise ModelError(f"{LOSS_CONTRACT}; its metrics are {_describe(metrics)} (return {{}} for none)")
    for name, value in metrics.items():
        if not isinstance(name, str) or not _is_numeric(value):
            raise ModelError(f"{LOSS_CONTRACT}; metric {name!r} is {_describe(value)}, not a numeric array or "
                             f"scalar")
    return loss, metrics


def make_rngs(key) -> nnx.Rngs:
    """The Rngs a loss function gets: a `dropout` stream and a default stream, both from `key` (a typed key)."""
    return nnx.Rngs(jax.random.fold_in(key, 0), dropout=jax.random.fold_in(key, 1))


def loss_and_grad(graphdef, loss_fn, params, model_state, batch, key, accum: int = 1):
    """Returns (loss, metrics, new model_state, grads) of `loss_fn(model, batch, rngs)` with respect to params.

    `loss_fn` is in the three-argument form (`with_rngs`); `key` is the typed key of this computation.
    accum > 1: gradient accumulation over `accum` equal microbatches (scanned, so activations of one microbatch are
    alive at a time); for a mean loss the result equals the full batch's. Microbatch m takes rows m, m + accum, ...,
    so every microbatch keeps its share of every data shard and nothing moves between devices. Microbatch m's key
    is `fold_in(key, m)`.
    """
    if accum > 1:
        return _accumulated(graphdef, loss_fn, params, model_state, batch, key, accum)
    model = nnx.merge(graphdef, params, model_state)
    if splits_loss(model):  # a stage mesh: the loss cut at the model's stack (its LayerRun, bound by the trainer)
        staged = staged_loss.loss_and_grad(graphdef, lambda m, b, k: call_loss(loss_fn, m, b, make_rngs(k)),
                                           params, model_state, batch, key)
        if staged is not None:
            return staged
    forward = lambda m: call_loss(loss_fn, m, batch, make_rngs(key))  # noqa: E731
    # nnx.value_and_grad (not jax's) lets the model update its own non-parameter state (RNG counters,
    # BatchNorm statistics) under differentiation; gradients are taken with respect to nnx.Param only.
    (loss, metrics), grads = nnx.value_and_grad(forward, has_aux=True)(model)
    new_model_state = split_model(model)[2]
    return loss, metrics, new_model_state, grads


def check_optimizer(where: str, tx) -> None:
    """Refuses anything but an optax GradientTransformation (an object with `init` and `update`).

    `where` names the argument: "optimizer", or "DiLoCo(outer_optimizer=...)" (the value replaces the "...").
    """
    if not all(callable(getattr(tx, method, None)) for method in optax.GradientTransformation._fields):
        shown = where.replace("...", repr(tx)) if "..." in where else f"{where} {tx!r}"
        raise ConfigError(f"{shown}: not an optax GradientTransformation (an object with init and update); pass "
                          f"e.g. optax.adamw(1e-3)")


def apply_gradients(tx: optax.GradientTransformation, params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def evaluate_batch(graphdef, loss_fn, params, model_state, batch, key):
    """Metrics of the three-argument `loss_fn` on one batch (graphdef in eval mode)."""
    model = nnx.merge(graphdef, params, model_state)
    loss, metrics = call_loss(loss_fn, model, batch, make_rngs(jax.random.fold_in(key, _EVAL_STREAM)))
    return {"loss": loss, **metrics}


def _accumulated(graphdef, loss_fn, params, model_state, batch, key, accum):
    micro = jax.tree.map(lambda x: x.reshape((x.shape[0] // accum, accum) + x.shape[1:]).swapaxes(0, 1), batch)

    def one(carry, inputs):  # params ride in the carry: NNX modules may only be built at their own trace level
        grads_sum, p, state = carry
        index, microbatch = inputs
        loss, metrics, state, grads = loss_and_grad(graphdef, loss_fn, p, state, microbatch,
                                                    jax.random.fold_in(key, index))
        return (jax.tree.map(jnp.add, grads_sum, grads), p, state), (loss, metrics)

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads_sum, _, model_state), (losses, metrics) = jax.lax.scan(
        one, (zeros, params, model_state), (jnp.arange(accum), micro))
    mean = functools.partial(jnp.mean, axis=0)
    return mean(losses), jax.tree.map(mean, metrics), model_state, jax.tree.map(lambda g: g / accum, grads_sum)


def guarded_step(variant, shardings, mesh, skip_nonfinite: bool):
    """The pure function a trainer jits for one strategy step variant: `variant.step`, then the non-finite check
    of the whole updated state over its `shardings` (keep the old state under skip, else flag), unless the variant
    checks itself (`variant.guards_itself`: Sync and SSP / ASP check before the update, `faults.guarded_update`;
    local SGD / DiLoCo each replica)."""
    def step(state: TrainState, batch, inputs):
        new, metrics = variant.step(state, batch, inputs)
        if variant.guards_itself:
            return new, metrics
        if skip_nonfinite:
            return keep_if_finite(state, new, metrics, shardings, mesh)
        return flag_if_not_finite(new, metrics, shardings, mesh)

    return step
