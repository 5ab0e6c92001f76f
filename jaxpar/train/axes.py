"""Axis names of a model's own collectives (pmap-era code), bound with size 1 around the loss: `batch_axis_names`.

A model written for `jax.pmap(..., axis_name="batch")` calls `lax.pmean(x, "batch")` itself, or uses Linen's
`nn.BatchNorm(axis_name="batch")`. jaxpar has no such axis: under `Sync()` the step is one program over the whole
global batch (split over devices by the compiler). Binding the name with size 1 (a `jax.vmap` with `axis_size=1`
that maps nothing) makes every collective over it the identity on a value already computed from the whole batch:
a BatchNorm mean over the global batch is exactly sync BatchNorm's, as under pmap.

Under the explicit strategies the loss runs once per replica (inside `shard_map` over the replica axis), so the same
binding is per replica: each replica is its own batch (BatchNorm statistics of its own slice).

This module is the one place that binds them: `bind_loss` around the trainer's loss functions (training and
evaluation), `bind` around `jaxpar.from_linen`'s Linen `apply`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.train.step import call_loss


def check_axis_names(names, mesh_axes: Iterable[str] = (), argument: str = "batch_axis_names") -> tuple[str, ...]:
    """`names` as a tuple of axis names (one string is one name); a mesh axis name is refused (jaxpar owns it)."""
    if names is None:
        return ()
    if isinstance(names, str):
        names = (names,)
    try:
        names = tuple(names)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{argument}: got {names!r}; pass a tuple of the axis names the model's collectives use, "
                          f"e.g. ('batch',)")
    taken = sorted(set(names) & set(mesh_axes))
    if taken:
        raise ConfigError(f"{argument}={names!r}: {taken[0]!r} is an axis of jaxpar's mesh; a model's own axis "
                          f"name (e.g. 'batch' of a pmap-era model) must be another name")
    return tuple(dict.fromkeys(names))


def bind(fn: Callable, names: tuple[str, ...]) -> Callable:
    """`fn(*args)` with `names` bound as axes of size 1 around it. Nothing is mapped: `args` (pytrees of arrays) go
    in whole, and so do the arrays `fn` closes over; each output comes out as it is (a leading 1 added and
    removed)."""
    if not names:
        return fn

    def bound(*args):
        call = fn
        for name in names:
            call = jax.vmap(call, in_axes=None, out_axes=0, axis_name=name, axis_size=1)
        return jax.tree.map(lambda x: x.reshape(x.shape[len(names):]), call(*args))

    return bound


def bind_loss(loss_fn: Callable, names: tuple[str, ...]) -> Callable:
    """A loss `(model, batch, rngs)` with `names` bound around it: the model and the rngs go in as their state
    (NNX objects may only be changed at their own trace level) and come back updated (BatchNorm statistics, RNG
    counters)."""
    if not names:
        return loss_fn

    def bound(model, batch, rngs):
        graphdef, state = nnx.split((model, rngs))

        def pure(state):  # an argument, not closed over: its variables then belong to the inner trace
            inner_model, inner_rngs = nnx.merge(graphdef, state)
            # checked inside: a loss that returns something other than arrays must hear why, not vmap's complaint
            out = call_loss(loss_fn, inner_model, batch, inner_rngs)
            return out, nnx.split((inner_model, inner_rngs))[1]

        out, new_state = bind(pure, names)(state)
        nnx.update((model, rngs), new_state)
        return out

    bound.batch_axis_names = names
    return bound
