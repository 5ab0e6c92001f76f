"""FSDP (ZeRO-3) placement: which dimension of a parameter is split over the fsdp axis.

FSDP placement only decides where bytes live, never the math, so unless `strict` it bends instead of failing,
whoever wrote the rules: a dimension mapped to the fsdp axis that does not divide moves the fsdp split to the largest
other dimension that divides (big_vision's rule), or leaves the parameter whole; and a parameter with no logical
names at all is split over fsdp the same way (its largest dimension that divides). Each parameter moved or left
whole is listed in the sharding notes (`ShardingNotes`). There is no size floor: a small array split over fsdp
costs a small all-gather (XLA can combine them), and a floor would make a small model's bytes per device depend on
sizes instead of on the mesh. `strict=True` follows the rules to the letter: such a dimension is an error, unnamed
parameters stay whole.
"""

from __future__ import annotations

from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.partitioning.specs import REPLICATED, entry_axes, from_entries


def fsdp_anywhere(shape, mesh: Mesh, where: str, notes=None, placed: P = REPLICATED) -> P:
    """The spec of a parameter without logical names (`placed`: the spec of the dimensions it names, a stacked
    block's layers): split over fsdp along its largest dimension that divides (big_vision's rule), or as placed when
    none does (listed in `notes`; a scalar has nothing to split)."""
    entries: list[tuple[str, ...]] = [(e,) if isinstance(e, str) else tuple(e or ()) for e in placed]
    entries += [()] * (len(shape) - len(entries))
    if mesh_lib.size(mesh, mesh_lib.FSDP_AXIS) == 1:
        return placed  # as for any parameter without names: nothing to split
    dim = place_elsewhere(entries, mesh_lib.axis_name(mesh, mesh_lib.FSDP_AXIS), mesh, shape)
    if notes is not None:
        if dim is not None:
            notes.fsdp_auto += 1
        elif len(shape):
            notes.whole.append((where, tuple(shape)))
    return from_entries(entries, mesh) if dim is not None else placed


def place_elsewhere(entries, axis, mesh, shape) -> int | None:
    """big_vision's fsdp rule for one axis: the largest dimension that divides (an unsplit one first, else one
    whose shard still divides) gets `axis` added to `entries`; its index, or None when none divides."""
    ways = mesh_lib.size(mesh, axis)

    def shard(dim):
        return shape[dim] // mesh_lib.size(mesh, entries[dim])

    free = [d for d in range(len(shape)) if not entries[d] and shape[d] % ways == 0]
    split = [d for d in range(len(shape)) if entries[d] and shard(d) % ways == 0]
    for group in (free, split):
        if group:
            dim = max(group, key=lambda d: (shape[d], -d))
            entries[dim] = entries[dim] + (axis,)
            return dim
    return None


def fsdp_split(sharding):
    """(dimension, the mesh axes that dimension is split over, in order) of the dimension a parameter's sharding
    splits over fsdp, or None when the parameter is whole over fsdp."""
    fsdp = mesh_lib.axis_name(sharding.mesh, mesh_lib.FSDP_AXIS)
    for dim, entry in enumerate(sharding.spec):
        names = entry_axes(entry)
        if fsdp in names:
            return dim, names
    return None
