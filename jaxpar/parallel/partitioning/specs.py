"""PartitionSpec primitives: the replicated and per-replica specs, reading and editing the mesh axes a spec names,
laying a traced value out, one block per device, and the bytes a device holds of a placed tree."""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.explicit_mesh import is_explicit

REPLICATED = P()  # whole on every device (in a shard_map: the same on every shard)
# A leading dimension over the replicas, one entry per replica: inside a replica-manual shard_map, the batch's rows
# (a slice per replica) or a stack of per-replica copies.
PER_REPLICA = P(mesh_lib.REPLICA_AXIS)


def from_entries(entries, mesh: Mesh) -> P:
    """The spec of one array from the mesh axes of each dimension (a tuple per dimension); axes of size 1 split
    nothing: leaving them out keeps specs readable (no fsdp entry on a mesh without fsdp)."""
    entries = [tuple(a for a in axes if mesh.shape[a] > 1) for axes in entries]
    return P(*[a[0] if len(a) == 1 else (a or None) for a in entries])


def is_sharding(x) -> bool:
    return isinstance(x, NamedSharding)


def entry_axes(entry) -> tuple:
    """The mesh axes one entry of a PartitionSpec names (None: none)."""
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def drop_axes(spec, keep) -> P:
    """`spec` with the mesh axes for which `keep(axis)` is false removed."""
    def one(entry):
        names = entry_axes(entry)
        kept = tuple(a for a in names if keep(a))
        return kept[0] if len(kept) == 1 else (kept or None)

    return P(*(one(e) for e in spec))


def split_axes(spec) -> set:
    """The mesh axes a spec splits some dimension over."""
    return {a for entry in spec for a in entry_axes(entry)}


def specs_of(shardings) -> list:
    """The PartitionSpec of each NamedSharding leaf, in tree order."""
    return [s.spec for s in jax.tree.leaves(shardings, is_leaf=is_sharding)]


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, REPLICATED)


def replicated_specs(tree):
    """`REPLICATED` for every leaf of `tree` (e.g. a communicator's state in a shard_map)."""
    return jax.tree.map(lambda _: REPLICATED, tree)


def constrain(tree, shardings):
    """`tree` laid out as `shardings` say, inside a traced function: `with_sharding_constraint` on an Auto mesh,
    `jax.sharding.reshard` on an Explicit one (where a sharding is part of the type and the constraint only
    asserts it)."""
    first = next(iter(jax.tree.leaves(shardings, is_leaf=is_sharding)), None)
    if first is not None and is_explicit(first.mesh):
        return jax.sharding.reshard(tree, shardings)
    return jax.lax.with_sharding_constraint(tree, shardings)


def device_grid_spec(mesh: Mesh) -> P:
    """One entry per device along every mesh axis (a per-device result gathered as [*mesh.shape, ...])."""
    return P(*mesh.axis_names)


def leading_over_devices(mesh: Mesh) -> NamedSharding:
    """The leading dimension split over every device of the mesh jointly: one block per device (calibration's
    per-device buffers)."""
    return NamedSharding(mesh, P(tuple(mesh.axis_names)))


def bytes_per_device(abstract_tree, shardings) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs placed by `shardings` (the largest device's share)."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings, is_leaf=is_sharding)):
        total += math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total
