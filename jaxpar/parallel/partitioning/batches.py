"""Batch layouts: the examples over the batch axes, and a replica's rows over fsdp inside a manual map."""

from __future__ import annotations

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.explicit_mesh import is_explicit


def batch_spec(leading=(), mesh=None) -> P:
    """Examples over the batch axes (by `mesh`'s names, if given); `leading` unsplit dimensions in front (e.g. a
    microbatch axis)."""
    if mesh is None:
        return P(*leading, mesh_lib.BATCH_AXES)
    axes = mesh_lib.axis_names(mesh, mesh_lib.BATCH_AXES)
    if is_explicit(mesh):  # a sharding is part of an Explicit array's type: axes of size 1 would show in it
        axes = tuple(a for a in axes if mesh.shape[a] > 1)
    return P(*leading, axes[0] if len(axes) == 1 else (axes or None))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (example) dimension split over the batch axes, everything else replicated."""
    return NamedSharding(mesh, batch_spec(mesh=mesh))


def fsdp_rows(mesh) -> P:
    """Inside a shard_map manual over fsdp: the rows of a replica's slice, a share per fsdp device."""
    return P(mesh_lib.axis_name(mesh, mesh_lib.FSDP_AXIS))
