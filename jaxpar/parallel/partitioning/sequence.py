"""Sequence layouts for context parallelism: an activation's sequence dimension (the one after the examples) split
over the seq axis, in the attention helper's map (`jaxpar.parallel.context`)."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from jaxpar.parallel import mesh as mesh_lib


def sequence_blocks(mesh) -> P:
    """Inside a map manual over the seq axis: [B, L, ...] with L split over it, one contiguous block per device (the
    other dimensions stay with the compiler: examples over data / fsdp, heads over model)."""
    return P(None, mesh_lib.axis_name(mesh, mesh_lib.SEQ_AXIS))
