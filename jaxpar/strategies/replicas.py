"""Per-replica plumbing shared by the explicit-collective strategies.

Inside `per_replica(...)` (a `jax.shard_map` manual over `data` only) each data replica runs its own copy of the
code on its slice of the batch, while the `model` axis stays with the compiler, so tensor parallelism keeps working
unchanged. Per-replica copies of parameters live in arrays with a leading replica dimension sharded over `data`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.collectives import allreduce_mean
from jaxpar.sharding import is_variable


def per_replica(ctx, fn, in_specs, out_specs):
    """`fn` runs once per data replica; `model` stays automatic.

    `check_vma=False`: results averaged by the hand-written collectives are replicated in value, but only a native
    collective lets shard_map's type check prove it.
    """
    return jax.shard_map(fn, mesh=ctx.mesh, in_specs=in_specs, out_specs=out_specs, axis_names={"data"},
                         check_vma=False)


def average_params_like(ctx, tree, algorithm: str, torus_x=None):
    """Mean over `data` of a params-shaped tree (gradients, parameters), on each device's own `model` shard.

    The hand-written algorithms fuse leaves into one flat buffer; done on the global (model-sharded) arrays, that
    flattening would first all-gather every tensor-parallel leaf over `model`. A nested shard_map manual over `model`
    makes each device fuse and send only its shard: the bytes over `data` shrink by the model-axis size.
    """
    if algorithm == "psum" or ctx.mesh.shape["model"] == 1:
        return allreduce_mean(tree, "data", algorithm, torus_x=torus_x)
    specs = jax.tree.map(lambda s: P(*[axis if axis == "model" else None for axis in s.spec]), ctx.param_shardings,
                         is_leaf=lambda x: isinstance(x, NamedSharding))
    # no `mesh=`: inside the outer shard_map the context mesh (data already manual) is the one to use
    return jax.shard_map(lambda t: allreduce_mean(t, "data", algorithm, torus_x=torus_x), in_specs=(specs,),
                         out_specs=specs, axis_names={"model"}, check_vma=False)(tree)


def replica_index():
    return lax.axis_index("data")


def _map_rng_keys(fn, model_state):
    return jax.tree.map(lambda v: v.replace(fn(v)) if isinstance(v, nnx.RngKey) else v, model_state,
                        is_leaf=is_variable)


def fold_rng_keys(model_state, index):
    """Each replica draws its own dropout masks: the same seed never gives two replicas the same mask."""
    return _map_rng_keys(lambda v: jax.random.fold_in(v.get_value(), index), model_state)


def unfold_rng_keys(new_model_state, original_model_state):
    """Keeps the updated RNG counters but the original (replica-independent) keys."""
    originals = iter(v.get_value() for v in jax.tree.leaves(original_model_state, is_leaf=is_variable)
                     if isinstance(v, nnx.RngKey))
    return _map_rng_keys(lambda v: next(originals), new_model_state)


def mean_float_state(model_state, algorithm: str, torus_x=None):
    """Averages floating-point model state (BatchNorm statistics) over replicas so that they stay identical."""
    leaves, treedef = jax.tree.flatten(model_state)
    floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]
    if floats:
        averaged = allreduce_mean([leaves[i] for i in floats], "data", algorithm, torus_x=torus_x)
        for i, x in zip(floats, averaged):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def stack(tree, count: int):
    """`count` identical copies along a new leading replica dimension."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (count,) + x.shape), tree)


def take_own(tree):
    """Inside `per_replica`: this replica's copy (the local leading dimension has size 1)."""
    return jax.tree.map(lambda x: x[0], tree)


def as_own(tree):
    return jax.tree.map(lambda x: x[None], tree)


def stacked_shardings(shardings):
    """The sharding of a per-replica copy: leading dimension over `data`, the rest as before."""

    def one(sharding):
        return NamedSharding(sharding.mesh, P("data", *sharding.spec))

    return jax.tree.map(one, shardings, is_leaf=lambda x: isinstance(x, NamedSharding))


def tree_sq_norm(tree):
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))
