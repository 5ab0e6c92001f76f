"""Sharding rules: a parameter's logical axis names -> mesh axes -> its `PartitionSpec`.

Models name the dimensions of their parameters (`nnx.with_partitioning(init, ("embed", "mlp"))`, or Linen's
`nn.with_logical_partitioning`); rules map each logical name to a mesh axis (or None = replicated). Rules come in
two forms:

- a dict `{"mlp": TENSOR_AXIS, "embed": FSDP_AXIS}` (axis names from jaxpar.parallel.mesh): one mesh axis per name;
  two dimensions of one parameter on the same mesh axis is a `ShardingError`;
- Flax's list of pairs `[("mlp", TENSOR_AXIS), ("embed", FSDP_AXIS), ("embed", None)]` (`logical_axis_rules`),
  with Flax's meaning: for each dimension the first rule for its name whose mesh axes the array does not already use
  applies; none applies -> replicated.

Path rules (`jaxpar.parallel.path_rules`) give a parameter its names by a regex over its path instead, so a model
nobody annotated can still be tensor-parallel. Anything no rule names is replicated. A rule naming a mesh axis the
mesh lacks, or a tensor-parallel or stage dimension that does not divide by its axis, is a `ShardingError` naming
the parameter, its shape and the mesh axis; an fsdp dimension that does not divide falls back (`fsdp_placement`)
unless `strict`.

    >>> spec_for(("embed", "mlp"), DEFAULT_RULES, mesh, "mlp.kernel.value")     # doctest: +SKIP
    PartitionSpec(<fsdp axis>, <tensor axis>)
"""

from __future__ import annotations

from collections.abc import Mapping

from jax.sharding import Mesh, PartitionSpec as P

from jaxpar.errors import ShardingError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.partitioning.fsdp_placement import place_elsewhere
from jaxpar.parallel.partitioning.specs import from_entries
from jaxpar.parallel.path_rules import MeshAxes

LAYERS = "layers"  # the logical name of a stacked block's leading (layer) dimension

# Megatron-style tensor parallelism (attention heads, the MLP hidden dimension and the vocabulary over the tensor
# axis) plus ZeRO-3 (the embedding dimension of every big matrix over the fsdp axis), and a stacked block's layers
# over the pipeline stages.
DEFAULT_RULES: dict[str, str | None] = {
    "embed": mesh_lib.FSDP_AXIS,
    "heads": mesh_lib.TENSOR_AXIS,
    "kv": None,
    LAYERS: mesh_lib.STAGE_AXIS,
    "mlp": mesh_lib.TENSOR_AXIS,
    "vocab": mesh_lib.TENSOR_AXIS,
}


def _axes_of(target) -> tuple[str, ...]:
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def normalize_rules(rules) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Rules as ordered (logical name, mesh axes) pairs; a dict becomes its items."""
    forms = (f"rules map a logical name to a mesh axis ({', '.join(mesh_lib.AXES)}), a tuple of them, or None: a dict "
             f"{{'mlp': '{mesh_lib.TENSOR_AXIS}'}} or a list of pairs [('mlp', '{mesh_lib.TENSOR_AXIS}')]")
    if isinstance(rules, Mapping):
        pairs = list(rules.items())
    elif isinstance(rules, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in rules):
        pairs = [tuple(p) for p in rules]
    else:
        raise ShardingError(f"rules {rules!r}: not a dict or a list of pairs; {forms}")
    out = []
    for name, target in pairs:
        axes = (target,) if isinstance(target, str) else target
        if not isinstance(name, str) or not (target is None or (
                isinstance(axes, (list, tuple)) and all(isinstance(a, str) for a in axes))):
            raise ShardingError(f"rules: rule {name!r} -> {target!r} is not a logical name -> mesh axis; {forms}")
        out.append((name, _axes_of(target)))
    return tuple(out)


def validate_rules(rules, mesh: Mesh) -> None:
    for logical, axes in normalize_rules(rules):
        for axis in mesh_lib.axis_names(mesh, axes):
            if axis not in mesh.axis_names:
                raise ShardingError(f"sharding rule {logical!r} -> {axis!r} names a mesh axis that does not exist; "
                                    f"mesh axes are {', '.join(mesh.axis_names)} (or None to replicate)")


def spec_for(logical_names, rules, mesh: Mesh, where: str, shape=None, strict: bool = True, notes=None,
             rule: str | None = None) -> P:
    """The PartitionSpec of one array whose dimensions carry `logical_names` (None = unnamed; a `MeshAxes` entry,
    from a path rule, names mesh axes directly).

    `strict=False` lets an fsdp placement that does not divide fall back (`fsdp_placement`); `notes`, a
    `ShardingNotes`, collects what fell back; `rule`: the path rule the names come from (for messages).
    """
    if logical_names is None:
        return P()
    is_list = not isinstance(rules, Mapping)
    pairs = normalize_rules(rules)
    entries: list[tuple[str, ...]] = []
    used: dict[str, int] = {}
    misplaced = []  # fsdp placements that did not divide (non-strict only)
    for dim, logical in enumerate(logical_names):
        if isinstance(logical, MeshAxes):
            candidates = [tuple(logical)]
        else:
            candidates = [axes for name, axes in pairs if name == logical] if logical is not None else []
        axes: tuple[str, ...] = ()
        candidates = [mesh_lib.axis_names(mesh, option) for option in candidates]  # roles -> the mesh's names
        for option in candidates:
            if is_list and any(a in used for a in option) and not isinstance(logical, MeshAxes):
                continue  # Flax: the next rule for this name whose mesh axes are still free
            axes = option
            break
        for axis in axes:
            if axis in used:
                shaped = "" if shape is None else f" of shape {tuple(shape)}"
                raise ShardingError(f"parameter {where}{shaped}: dimensions {used[axis]} "
                                    f"({logical_names[used[axis]]!r}) and {dim} ({logical!r}) both map to mesh axis "
                                    f"{axis!r}; change the {'path rule' if rule else 'rules'} so each mesh axis "
                                    f"shards at most one dimension")
            used[axis] = dim
        if shape is not None and axes and shape[dim] % mesh_lib.size(mesh, axes):
            fsdp = mesh_lib.axis_name(mesh, mesh_lib.FSDP_AXIS)
            soft = tuple(a for a in axes if a == fsdp)
            hard = tuple(a for a in axes if a != fsdp)
            if strict or shape[dim] % mesh_lib.size(mesh, hard):
                failing = hard if hard and shape[dim] % mesh_lib.size(mesh, hard) else axes
                raise ShardingError(_indivisible(where, shape, dim, logical, failing, mesh, rule))
            for axis in soft:
                misplaced.append(axis)
                del used[axis]
            axes = hard
        entries.append(axes)
    for axis in misplaced:
        dim = place_elsewhere(entries, axis, mesh, shape)
        if notes is not None and dim is not None:
            notes.moved.append((where, tuple(shape), dim))
        elif notes is not None:
            notes.whole.append((where, tuple(shape)))
    return from_entries(entries, mesh)


def _indivisible(where, shape, dim, logical, axes, mesh: Mesh, rule) -> str:
    """One line for a dimension that does not divide by its mesh axes, reading right whatever the names are."""
    ways, joined = mesh_lib.size(mesh, axes), " x ".join(axes)
    if isinstance(logical, MeshAxes):
        named, change = f"path rule {rule!r}", "or change the path rule"
    else:
        named = f"logical {logical!r}" + (f", from path rule {rule!r}" if rule else "")
        change = f"or map {logical!r} to None in the rules"
    fix = f"make that dimension a multiple of {ways}, use a smaller {joined} axis, {change}"
    if axes == mesh_lib.axis_names(mesh, mesh_lib.STAGE_AXIS):  # unsplit layers leave nothing to pipeline: no None
        fits = max(d for d in range(1, ways + 1) if shape[dim] % d == 0)
        fix = f"make that dimension a multiple of {ways}, or use a {joined} axis that divides {shape[dim]} (e.g. " \
              f"{joined}={fits})"
    return (f"parameter {where} of shape {tuple(shape)}: dimension {dim} ({named}) = {shape[dim]} is not divisible "
            f"by mesh axis {joined!r} of size {ways}; {fix}")
