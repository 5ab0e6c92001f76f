"""Pipeline stages: parameters split over the stage axis, and the layouts inside a stage map (`over_stages`).

A stacked block's parameters have a leading dimension named `layers` (`nnx.vmap` with
`transform_metadata={nnx.PARTITION_NAME: "layers"}` puts it first), and the rule `layers -> stage` splits the
layers over the stage axis, a contiguous run of them per stage. On a mesh with stage > 1 some parameter must be
split over it: a model with nothing to pipeline is a `ShardingError` (one line saying what is missing).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.errors import ShardingError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.partitioning.rules import LAYERS
from jaxpar.parallel.partitioning.specs import split_axes

STAGE_SPLIT = P(mesh_lib.STAGE_AXIS)  # a leading dimension split over the stages (each holds its run of layers)


def check_stages(params, mesh: Mesh) -> None:
    """On a mesh with stage > 1, some parameter (given as (logical names, spec) pairs) must be split over the stage
    axis: otherwise every stage would hold and run the whole model, and the pipeline would have nothing to split.
    No parameters at all (a state of buffers only) is not checked."""
    stages = mesh_lib.size(mesh, mesh_lib.STAGE_AXIS)
    stage = mesh_lib.axis_name(mesh, mesh_lib.STAGE_AXIS)
    if stages == 1 or not params or any(stage in split_axes(spec) for _, spec in params):
        return
    where = f"mesh {mesh_lib.STAGE_AXIS}={stages}"
    no_stage = f"use a mesh without {mesh_lib.STAGE_AXIS}"
    if any(LAYERS in names for names, _ in params):
        raise ShardingError(f"{where}: the model's stacked layers (logical axis {LAYERS!r}) are not split over "
                            f"stages because the rules do not map {LAYERS!r} to {mesh_lib.STAGE_AXIS!r}; add that "
                            f"rule (jaxpar.DEFAULT_RULES has it), or {no_stage}")
    raise ShardingError(f"{where}: the model has no stacked layers to split over stages (no parameter has the logical "
                        f"axis {LAYERS!r}); build its repeated blocks with jaxpar.pipeline.Stack, or {no_stage}")


def stage_rows_axis(mesh: Mesh) -> str | None:
    """The data axis a stage map is manual over besides the stage axis, or None (data of size 1, or already manual:
    inside a replica-manual shard_map each replica's rows are its own).

    Why manual: with data automatic inside the stage map, XLA's partitioner all-reduces every tick's parameter
    gradient over data (the tick's weight-gradient contraction runs over rows split over data, and the loop carry
    that accumulates it is replicated): M + S - 1 gradient averages per step. Manual over data, each device
    accumulates its rows' gradients locally over the ticks and one psum over data follows the loop."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        return None
    data = mesh_lib.axis_name(mesh, mesh_lib.REPLICA_AXIS)
    return data if mesh.shape.get(data, 1) > 1 else None


def stage_row_shards(mesh: Mesh) -> int:
    """The shards a stage map splits every microbatch's rows into (the size of `stage_rows_axis`)."""
    rows = stage_rows_axis(mesh)
    return 1 if rows is None else mesh.shape[rows]


def stage_rows(mesh: Mesh, dim: int, staged: bool = False) -> P:
    """Inside a stage map (`over_stages`): an array whose dimension `dim` holds the batch's rows, split over the
    map's data axis (`stage_rows_axis`; not split when there is none); `staged`: its leading dimension over the
    stages too (the schedules' per-stage outputs)."""
    entries = [None] * (dim + 1)
    entries[dim] = stage_rows_axis(mesh)
    if staged:
        entries[0] = mesh_lib.STAGE_AXIS
    return P(*entries)


def over_stages(fn, mesh: Mesh, in_specs, out_specs):
    """`fn` in a `shard_map` manual over the stage axis and the data axis of `stage_rows_axis` (fsdp and model stay
    automatic inside a stage); specs are `STAGE_SPLIT`, `stage_rows` or `REPLICATED` (the same on every stage and
    data shard). Unchecked replication: the schedules send and sum over the stage axis themselves; an input
    replicated over data gets its cotangent summed over data once, after the backward (shard_map's transpose).
    Inside a replica-manual shard_map (the explicit strategies) the stage map nests in it, on the context's mesh
    (whose replica axis is already manual)."""
    context = jax.sharding.get_abstract_mesh()
    rows = stage_rows_axis(mesh)
    if not context.empty and context.manual_axes:
        mesh = context
    axes = {mesh_lib.STAGE_AXIS} | ({rows} if rows else set())
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=axes, check_vma=False)
