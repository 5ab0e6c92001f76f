"""Restore layouts: where a saved array is read onto the mesh."""

from __future__ import annotations

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.parallel.partitioning.specs import replicated


def restore_sharding(mesh: Mesh, like: NamedSharding | None, stacked_copy: bool = False) -> NamedSharding:
    """Where to read a saved array: like the strategy-free leaf it is (`like`), or a stack of such leaves with an
    unsplit leading dimension (`stacked_copy`), or whole (`like` None)."""
    if like is None:
        return replicated(mesh)
    return NamedSharding(mesh, P(None, *like.spec)) if stacked_copy else like
