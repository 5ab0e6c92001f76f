"""What placing the train state tells its user at start-up: parameters the fsdp placement moved or left whole,
logical names no rule mentions, and a model without annotations (pointing at its own library's annotation API).

`jaxpar.parallel.partitioning.state_shardings` fills a `ShardingNotes` while it places the train state; the Trainer
reports `ShardingNotes.lines(mesh)` once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jax.sharding import Mesh

from jaxpar.parallel import mesh as mesh_lib

ANNOTATION_API = {"nnx": "nnx.with_partitioning", "linen": "nn.with_logical_partitioning"}


@dataclass
class ShardingNotes:
    """What placing the train state decided that a user should hear about (each reported once, at start-up)."""

    library: str = "nnx"  # the model's own library (a key of ANNOTATION_API): the API the notes point to
    moved: list = field(default_factory=list)  # (parameter, shape, dim): fsdp moved to another dimension
    whole: list = field(default_factory=list)  # (parameter, shape): fsdp could not split it: whole on each device
    unruled: set = field(default_factory=set)  # logical names used by the model that no rule mentions
    annotated: int = 0  # parameters with logical names (their own, or from a path rule)
    fsdp_auto: int = 0  # parameters without names split over fsdp automatically
    parameters: int = 0

    def lines(self, mesh: Mesh) -> list[str]:
        out = []
        tensor_axis, fsdp_axis = (mesh_lib.axis_name(mesh, a) for a in (mesh_lib.TENSOR_AXIS, mesh_lib.FSDP_AXIS))
        if self.parameters and not self.annotated and mesh_lib.size(mesh, mesh_lib.PARAMETER_AXES) > 1:
            how = f"name their dimensions with {ANNOTATION_API[self.library]}, or pass path_rules"
            tensor = mesh_lib.size(mesh, mesh_lib.TENSOR_AXIS)
            if not self.fsdp_auto:
                out.append(f"the model names no parameter dimensions and none was split automatically, so every "
                           f"parameter is replicated on all {mesh.size} devices; to shard them, {how}")
            else:
                idle = (f"; nothing is split over {tensor_axis}, whose {tensor} devices hold the same "
                        f"shards") if tensor > 1 else ""
                out.append(f"the model names no parameter dimensions, so {self.fsdp_auto} of its {self.parameters} "
                           f"parameters are split over {fsdp_axis} along their largest dimension that "
                           f"divides by {mesh_lib.size(mesh, mesh_lib.FSDP_AXIS)}{idle}; to choose the split (or "
                           f"for tensor parallelism), {how}")
        if self.unruled:
            out.append(f"logical axis names {', '.join(sorted(self.unruled))} appear in the model but in no sharding "
                       f"rule, so those dimensions are replicated; add a rule (or map them to None to silence this)")
        if self.whole:
            listed = ", ".join(f"{name} {list(shape)}" for name, shape in self.whole[:6])
            more = f" and {len(self.whole) - 6} more" if len(self.whole) > 6 else ""
            out.append(f"fsdp: {len(self.whole)} parameter(s) stay whole on every {fsdp_axis} device (no "
                       f"dimension divides by {mesh_lib.size(mesh, mesh_lib.FSDP_AXIS)}): {listed}{more}")
        if self.moved:
            listed = ", ".join(f"{name} {list(shape)} on dim {dim}" for name, shape, dim in self.moved[:6])
            out.append(f"fsdp: {len(self.moved)} parameter(s) split along another dimension than the rules name: "
                       f"{listed}")
        return out
