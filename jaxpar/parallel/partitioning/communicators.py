"""Communicator layouts: a compressed communicator's state (its per-replica part stacked over the replicas, the
rest replicated) and PowerSGD's factors cut inside a replica like the matrix they approximate."""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.parallel.partitioning.replicas import stacked, within_replica_specs, within_replica_splits
from jaxpar.parallel.partitioning.specs import PER_REPLICA, replicated, replicated_specs

COMM_OWN = "own"  # a compressed communicator's per-replica part (jaxpar.parallel.compression.OWN)


def _split_comm(state):
    """(the per-replica part, if `state` is a compressed communicator's with a non-empty one, else None)."""
    if isinstance(state, dict) and COMM_OWN in state and jax.tree.leaves(state[COMM_OWN]):
        return state[COMM_OWN]
    return None


def _params_like(own, params_tree, fn):
    """`fn(params_tree)` laid out like `own`: the per-replica part is params-shaped, or a dict of params-shaped
    parts (int8's owner and sender residuals)."""
    if jax.tree.structure(own) == jax.tree.structure(params_tree, is_leaf=lambda x: isinstance(x, P)) or \
            not isinstance(own, dict):
        return fn(params_tree)
    return {key: fn(params_tree) for key in own}


def communicator_shardings(abstract_state, param_shardings, mesh: Mesh):
    """A communicator's state: its per-replica part (params-shaped, e.g. error-feedback residuals, or a dict of such
    parts) stacked over the replicas like per-replica parameters; everything else replicated."""
    out = jax.tree.map(lambda _: replicated(mesh), abstract_state)
    own = _split_comm(abstract_state)
    if own is not None:
        out[COMM_OWN] = _params_like(own, param_shardings, stacked)
    return out


def communicator_specs(state, param_shardings=None):
    """Specs of a communicator's state in a replica-manual shard_map (the per-replica part: `PER_REPLICA`), or,
    with `param_shardings`, in the nested shard_map manual over the within-replica axes (the per-replica part:
    its leading dimension whole, the rest like the parameters' shards)."""
    out = replicated_specs(state)
    own = _split_comm(state)
    if own is not None:
        out[COMM_OWN] = (jax.tree.map(lambda _: PER_REPLICA, own) if param_shardings is None else
                         _params_like(own, within_replica_specs(param_shardings),
                                      lambda specs: jax.tree.map(lambda s: P(None, *s), specs,
                                                                 is_leaf=lambda x: isinstance(x, P))))
    return out


def factor_splits(splits, k: int = 1) -> tuple[int, int]:
    """(P's row pieces, Q's row pieces) of PowerSGD's factors of a parameter viewed as the matrix (dimensions
    before k, dimensions from k on) (`jaxpar.parallel.compression.powersgd.matrix_split`), cut inside a replica like
    the matrix (`splits`: `within_replica_splits`): P like dimension 0 when no other row dimension is cut, Q like
    dimension k when no later dimension is cut (then each device's rows, or columns, are one block), else whole."""
    rows = splits[0] if math.prod(splits[1:k]) == 1 else 1
    return rows, (splits[k] if len(splits) > k and math.prod(splits[k + 1:]) == 1 else 1)


def factor_specs(sharding, ndim: int, k: int = 1) -> tuple[P, P]:
    """The within-replica specs of PowerSGD's P (n x R) and Q (m x R) for a parameter of `ndim` dimensions laid out
    by `sharding` and viewed as a matrix cut before dimension k, as `factor_splits` cuts them: each device exchanges
    only its rows of each factor."""
    spec = tuple(within_replica_specs(sharding)) + (None,) * ndim
    rows, cols = factor_splits(within_replica_splits(sharding, ndim), k)
    return P(spec[0] if rows > 1 else None, None), P(spec[k] if cols > 1 else None, None)
