"""Replica layouts: stacks of per-replica copies, a parameter as used under ZeRO-3 (gathered over fsdp), and a
replica's own shard of each leaf inside a shard_map manual over the within-replica axes (the hand-written
reduce-scatter over fsdp included)."""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.partitioning.fsdp_placement import fsdp_split
from jaxpar.parallel.partitioning.specs import REPLICATED, drop_axes, entry_axes, is_sharding


def stacked(shardings, over_replicas: bool = True):
    """The shardings of a stack of copies along a new leading dimension: over the replica axis (per-replica
    copies), or unsplit (a buffer of versions); the other dimensions as before."""
    lead = mesh_lib.REPLICA_AXIS if over_replicas else None
    return jax.tree.map(lambda s: NamedSharding(s.mesh, P(lead, *s.spec)), shardings, is_leaf=is_sharding)


def gathered_over(shardings, axis: str):
    """The shardings with `axis` dropped from every spec: the layout a parameter is used in under ZeRO-3 (whole over
    fsdp, still split over model), while it is stored as `shardings` say."""
    return jax.tree.map(lambda s: NamedSharding(s.mesh, drop_axes(s.spec, lambda a: a != mesh_lib.axis_name(
        s.mesh, axis))), shardings, is_leaf=is_sharding)


def replicate_within(tree):
    """Inside a replica-manual shard_map: every leaf whole on each of the replica's devices."""
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, REPLICATED), tree)


def within_replica_specs(shardings):
    """The specs of one replica's shard of each leaf, for a shard_map manual over the within-replica axes (what a
    device holds of a parameter inside its replica): every axis but the within-replica ones dropped."""
    inside = set(mesh_lib.WITHIN_REPLICA_AXES)
    return jax.tree.map(lambda s: drop_axes(s.spec, lambda a: a in inside), shardings, is_leaf=is_sharding)


def within_replica_axes(sharding) -> tuple:
    """The within-replica axes (of size > 1) a leaf laid out by `sharding` is split over: leaves with the same
    axes differ between exactly the same devices of a replica (an elementwise codec may mix them in one chunk)."""
    inside = set(mesh_lib.WITHIN_REPLICA_AXES)
    return tuple(sorted(a for entry in sharding.spec for a in entry_axes(entry)
                        if a in inside and sharding.mesh.shape[a] > 1))


def within_replica_splits(sharding, ndim: int) -> tuple:
    """How many pieces each of a parameter's `ndim` dimensions is cut into inside a replica (over fsdp / model)."""
    inside = set(mesh_lib.WITHIN_REPLICA_AXES)
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return tuple(math.prod(sharding.mesh.shape[a] for a in entry_axes(entry) if a in inside) for entry in spec)


def per_fsdp_device(mesh) -> P:
    """Inside a shard_map manual over fsdp: a stack with one entry per fsdp device (a leading dimension over fsdp),
    e.g. each device's own unreduced gradient before the hand-written reduce-scatter."""
    return P(mesh_lib.axis_name(mesh, mesh_lib.FSDP_AXIS))


def fsdp_reduce_specs(shardings):
    """(in_specs, out_specs) of the reduce-scatter over fsdp, a shard_map manual over every within-replica axis:
    in, each device's unreduced gradient stacked over fsdp (`per_fsdp_device`), split over the other axes like the
    parameter except on the dimension that is split over fsdp (kept whole: the device picks its block of it);
    out, the parameter's own shard (`within_replica_specs`)."""
    inside = set(mesh_lib.WITHIN_REPLICA_AXES)

    def unreduced(s):
        fsdp = mesh_lib.axis_name(s.mesh, mesh_lib.FSDP_AXIS)
        split = fsdp_split(s)
        kept = drop_axes(s.spec, lambda a: a in inside and a != fsdp)
        entries = [None if split is not None and d == split[0] else e for d, e in enumerate(kept)]
        return P(fsdp, *entries)

    return (jax.tree.map(unreduced, shardings, is_leaf=is_sharding), within_replica_specs(shardings))
