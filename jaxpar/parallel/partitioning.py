"""Every partitioning decision: logical axis names -> mesh axes -> `NamedSharding`.

Why about 580 lines: every PartitionSpec and NamedSharding of the project is built here on purpose (one owner), so
the rules, FSDP placement, batch, per-replica, gathered and restore layouts, the pipeline's stage-row layouts, a
codec's per-replica state, PowerSGD's factors and calibration's per-device buffers sit side by side (path rules:
their matching lives in `path_rules.py`, their specs here). Split, each part would build specs a lint forbids
outside this module.

Models name the dimensions of their parameters (`nnx.with_partitioning(init, ("embed", "mlp"))`, or Linen's
`nn.with_logical_partitioning`); rules map each logical name to a mesh axis (or None = replicated). Rules come in
two forms:

- a dict `{"mlp": TENSOR_AXIS, "embed": FSDP_AXIS}` (axis names from jaxpar.parallel.mesh): one mesh axis per name;
  two dimensions of one parameter on the same mesh axis is a `ShardingError`;
- Flax's list of pairs `[("mlp", TENSOR_AXIS), ("embed", FSDP_AXIS), ("embed", None)]` (`logical_axis_rules`),
  with Flax's meaning: for each dimension the first rule for its name whose mesh axes the array does not already use
  applies; none applies -> replicated.

Path rules (`jaxpar.parallel.path_rules`) give a parameter its names by a regex over its path instead, so a model
nobody annotated can still be tensor-parallel. Anything no rule names is replicated; names the model uses that no
rule mentions are reported once (a typo like `mpl` must not silently replicate a big matrix). A rule naming a mesh
axis the mesh lacks, or a tensor-parallel or stage dimension that does not divide by its axis, is a `ShardingError`
naming the parameter, its shape and the mesh axis.

Pipeline stages: a stacked block's parameters have a leading dimension named `layers` (`nnx.vmap` with
`transform_metadata={nnx.PARTITION_NAME: "layers"}` puts it first), and the rule `layers -> stage` splits the
layers over the stage axis, a contiguous run of them per stage. On a mesh with stage > 1 some parameter must be
split over it: a model with nothing to pipeline is a `ShardingError` (one line saying what is missing).

FSDP (ZeRO-3) placement only decides where bytes live, never the math, so unless `strict` it bends instead of
failing, whoever wrote the rules: a dimension mapped to the fsdp axis that does not divide moves the fsdp split to
the largest other dimension that divides (big_vision's rule), or leaves the parameter whole; and a parameter with
no logical names at all is split over fsdp the same way (its largest dimension that divides). Each parameter moved
or left whole is listed in the plan's notes. There is no size floor: a small array split over fsdp costs a small
all-gather (XLA can combine them), and a floor would make a small model's bytes per device depend on sizes instead of
on the mesh. `strict=True` follows the rules to the letter: such a dimension is an error, unnamed parameters stay
whole.

    >>> spec_for(("embed", "mlp"), DEFAULT_RULES, mesh, "mlp.kernel.value")     # doctest: +SKIP
    PartitionSpec(<fsdp axis>, <tensor axis>)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.plan_notes import PlanNotes
from jaxpar.errors import ShardingError
from jaxpar.names import variable_name
from jaxpar.parallel.path_rules import MeshAxes, dimension_names, match, normalize_path_rules, rule_path

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

Rules = "Mapping[str, str | tuple[str, ...] | None] | Sequence[tuple[str, str | tuple[str, ...] | None]]"


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

    `strict=False` lets an fsdp placement that does not divide fall back (see the module docstring); `notes`, a
    `PlanNotes`, collects what fell back; `rule`: the path rule the names come from (for messages).
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
        dim = _place_elsewhere(entries, axis, mesh, shape)
        if notes is not None and dim is not None:
            notes.moved.append((where, tuple(shape), dim))
        elif notes is not None:
            notes.whole.append((where, tuple(shape)))
    return _spec(entries, mesh)


def fsdp_anywhere(shape, mesh: Mesh, where: str, notes=None, placed: P = P()) -> P:
    """The spec of a parameter without logical names (`placed`: the spec of the dimensions it names, a stacked
    block's layers): split over fsdp along its largest dimension that divides (big_vision's rule), or as placed when
    none does (listed in `notes`; a scalar has nothing to split)."""
    entries: list[tuple[str, ...]] = [(e,) if isinstance(e, str) else tuple(e or ()) for e in placed]
    entries += [()] * (len(shape) - len(entries))
    if mesh_lib.size(mesh, mesh_lib.FSDP_AXIS) == 1:
        return placed  # as for any parameter without names: nothing to split
    dim = _place_elsewhere(entries, mesh_lib.axis_name(mesh, mesh_lib.FSDP_AXIS), mesh, shape)
    if notes is not None:
        if dim is not None:
            notes.fsdp_auto += 1
        elif len(shape):
            notes.whole.append((where, tuple(shape)))
    return _spec(entries, mesh) if dim is not None else placed


def _spec(entries, mesh: Mesh) -> P:
    # axes of size 1 split nothing: leaving them out keeps specs readable (no fsdp entry on a mesh without fsdp)
    entries = [tuple(a for a in axes if mesh.shape[a] > 1) for axes in entries]
    return P(*[a[0] if len(a) == 1 else (a or None) for a in entries])


def _indivisible(where, shape, dim, logical, axes, mesh: Mesh, rule) -> str:
    """One line for a dimension that does not divide by its mesh axes, reading right whatever the names are."""
    ways, joined = mesh_lib.size(mesh, axes), " x ".join(axes)
    if isinstance(logical, MeshAxes):
        named, change = f"path rule {rule!r}", "or change the path rule"
    else:
        named = f"logical {logical!r}" + (f", from path rule {rule!r}" if rule else "")
        change = f"or map {logical!r} to None in the rules"
    fix = f"make that dimension a multiple of {ways}, use a smaller {joined} axis, {change}"
    if axes == mesh_lib.axis_names(mesh, mesh_lib.STAGE_AXIS):  # unsplit layers would leave nothing to pipeline: no None
        fits = max(d for d in range(1, ways + 1) if shape[dim] % d == 0)
        fix = f"make that dimension a multiple of {ways}, or use a {joined} axis that divides {shape[dim]} (e.g. " \
              f"{joined}={fits})"
    return (f"parameter {where} of shape {tuple(shape)}: dimension {dim} ({named}) = {shape[dim]} is not divisible "
            f"by mesh axis {joined!r} of size {ways}; {fix}")


def _place_elsewhere(entries, axis, mesh, shape) -> int | None:
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


def logical_names_of(variable: nnx.Variable):
    meta = variable.get_metadata()
    return meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")


def is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def own_axes(names, variable, ruled, mesh: Mesh):
    """A variable's dimension names with those that name mesh axes (and no rule) marked `MeshAxes`: a model
    written for explicit sharding (`nnx.with_partitioning(init, P("fsdp", "tp"))`) places its parameters itself.
    Without names, the spec of the sharding its initializer gave it (`init(key, shape, out_sharding=P(...))`, traced
    under `jax.set_mesh`), if any. Other names stay logical names for the rules."""
    if not names and is_variable(variable):
        sharding = getattr(variable.get_value(), "sharding", None)
        spec = getattr(sharding, "spec", None) if isinstance(sharding, NamedSharding) else None
        names = tuple(spec) if spec is not None and any(e is not None for e in spec) else names
    if not names:
        return names
    mesh_axes = set(mesh.axis_names) | set(mesh_lib.AXES)

    def one(name):
        group = (name,) if isinstance(name, str) else name
        if (isinstance(group, tuple) and group and not isinstance(name, MeshAxes)
                and all(isinstance(a, str) and a in mesh_axes and a not in ruled for a in group)):
            return MeshAxes(group)
        return name

    return tuple(one(n) for n in names)


def state_shardings(abstract_state, rules, mesh: Mesh, strict: bool = True, notes: PlanNotes | None = None,
                    path_rules=(), path_root: int = 0):
    """NamedShardings for an (abstract) nnx.State, from each Variable's logical names and the rules.

    A parameter (`nnx.Param`) that a path rule matches takes that rule's names instead of its own (the path starts
    `path_root` keys into the state: a wrapper's prefix). With `strict=False`, a parameter with no names at all is
    split over fsdp by `fsdp_anywhere`; other variables without names stay whole. On a mesh with stage > 1, a state
    holding parameters none of which is split over the stage axis is a `ShardingError` (see `check_stages`)."""
    ruled = {name for name, _ in normalize_rules(rules)}
    by_path = normalize_path_rules(path_rules)
    params: list[tuple[tuple, P]] = []  # (logical names, spec) of each nnx.Param

    def one(path, variable):
        names = own_axes(logical_names_of(variable) if is_variable(variable) else None, variable, ruled, mesh)
        shape = getattr(variable, "shape", None)
        where, rule = variable_name(path, variable), None
        is_param = isinstance(variable, nnx.Param)
        if is_param and by_path and shape is not None:
            found = match(by_path, rule_path(path[path_root:]))
            if found is not None:
                rule, names = found.text, dimension_names(found, shape, where, mesh.axis_names)
        # a Stack of blocks without names names only the layer dimension: the rest is as unnamed as before
        layers_only = bool(names) and rule is None and names[0] == LAYERS and not any(names[1:])
        if notes is not None and is_param:
            notes.parameters += 1
            if names and not layers_only:
                notes.annotated += 1
                notes.unruled.update(n for n in names if isinstance(n, str) and n not in ruled)
        if is_param and (not names or layers_only) and not strict and shape is not None:
            placed = spec_for(names, rules, mesh, where, shape, strict, notes) if names else REPLICATED
            spec = fsdp_anywhere(shape, mesh, where, notes, placed)
        else:
            spec = spec_for(names, rules, mesh, where, shape, strict, notes, rule)
        if is_param:
            params.append((tuple(n for n in names or () if isinstance(n, str) or n is None), spec))
        return NamedSharding(mesh, spec)

    shardings = jax.tree_util.tree_map_with_path(one, abstract_state, is_leaf=is_variable)
    check_stages(params, mesh)
    return shardings


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


def optimizer_shardings(tx: optax.GradientTransformation, abstract_opt_state, param_shardings, mesh: Mesh):
    """Optimizer state leaves shaped like parameters are sharded like them; everything else is replicated."""
    return optax.tree_map_params(tx, lambda _, sharding: sharding, abstract_opt_state, param_shardings,
                                 transform_non_params=lambda _: replicated(mesh), is_leaf=is_variable)


# --- specs and shardings of everything else: one place builds them all ------------------------------------------
REPLICATED = P()  # whole on every device (in a shard_map: the same on every shard)
REPLICA_ROWS = P(mesh_lib.REPLICA_AXIS)  # inside a replica-manual shard_map: the batch's rows, a slice per replica
PER_REPLICA = P(mesh_lib.REPLICA_AXIS)  # a stack with one entry per replica (leading dimension over the replicas)


def fsdp_rows(mesh) -> P:
    """Inside a shard_map manual over fsdp: the rows of a replica's slice, a share per fsdp device."""
    return P(mesh_lib.axis_name(mesh, mesh_lib.FSDP_AXIS))


def _is_sharding(x) -> bool:
    return isinstance(x, NamedSharding)


def _entry_axes(entry) -> tuple:
    """The mesh axes one entry of a PartitionSpec names (None: none)."""
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _drop_axes(spec, keep) -> P:
    """`spec` with the mesh axes for which `keep(axis)` is false removed."""
    def one(entry):
        names = _entry_axes(entry)
        kept = tuple(a for a in names if keep(a))
        return kept[0] if len(kept) == 1 else (kept or None)

    return P(*(one(e) for e in spec))


def gathered_over(shardings, axis: str):
    """The shardings with `axis` dropped from every spec: the layout a parameter is used in under ZeRO-3 (whole over
    fsdp, still split over model), while it is stored as `shardings` say."""
    return jax.tree.map(lambda s: NamedSharding(s.mesh, _drop_axes(s.spec, lambda a: a != mesh_lib.axis_name(
        s.mesh, axis))), shardings, is_leaf=_is_sharding)


def constrain(tree, shardings):
    """`tree` laid out as `shardings` say, inside a traced function: `with_sharding_constraint` on an Auto mesh,
    `jax.sharding.reshard` on an Explicit one (where a sharding is part of the type and the constraint only
    asserts it)."""
    first = next(iter(jax.tree.leaves(shardings, is_leaf=_is_sharding)), None)
    if first is not None and mesh_lib.is_explicit(first.mesh):
        return jax.sharding.reshard(tree, shardings)
    return jax.lax.with_sharding_constraint(tree, shardings)


def within_replica_specs(shardings):
    """The specs of one replica's shard of each leaf, for a shard_map manual over the within-replica axes (what a
    device holds of a parameter inside its replica): every axis but the within-replica ones dropped."""
    inside = set(mesh_lib.WITHIN_REPLICA_AXES)
    return jax.tree.map(lambda s: _drop_axes(s.spec, lambda a: a in inside), shardings, is_leaf=_is_sharding)


def within_replica_splits(sharding, ndim: int) -> tuple:
    """How many pieces each of a parameter's `ndim` dimensions is cut into inside a replica (over fsdp / model)."""
    inside = set(mesh_lib.WITHIN_REPLICA_AXES)
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return tuple(math.prod(sharding.mesh.shape[a] for a in _entry_axes(entry) if a in inside) for entry in spec)


def factor_splits(splits) -> tuple[int, int]:
    """(P's row pieces, Q's row pieces) of PowerSGD's factors of a parameter viewed as the matrix (shape[0], the
    rest), cut inside a replica like the matrix (`splits`: `within_replica_splits`): P like dimension 0; Q like
    dimension 1 when no later dimension is cut (then each device's columns are one block), else whole."""
    return splits[0], (splits[1] if len(splits) >= 2 and math.prod(splits[2:]) == 1 else 1)


def factor_specs(sharding, ndim: int) -> tuple[P, P]:
    """The within-replica specs of PowerSGD's P (n x R) and Q (m x R) for a parameter laid out by `sharding`, as
    `factor_splits` cuts them: each device exchanges only its rows of each factor."""
    spec = tuple(within_replica_specs(sharding)) + (None,) * ndim
    rows, cols = factor_splits(within_replica_splits(sharding, ndim))
    return P(spec[0] if rows > 1 else None, None), P(spec[1] if cols > 1 else None, None)


def per_fsdp_device(mesh) -> P:
    """Inside a shard_map manual over fsdp: a stack with one entry per fsdp device (a leading dimension over fsdp),
    e.g. each device's own unreduced gradient before the hand-written reduce-scatter."""
    return P(mesh_lib.axis_name(mesh, mesh_lib.FSDP_AXIS))


def fsdp_split(sharding):
    """(dimension, the mesh axes that dimension is split over, in order) of the dimension a parameter's sharding
    splits over fsdp, or None when the parameter is whole over fsdp."""
    fsdp = mesh_lib.axis_name(sharding.mesh, mesh_lib.FSDP_AXIS)
    for dim, entry in enumerate(sharding.spec):
        names = _entry_axes(entry)
        if fsdp in names:
            return dim, names
    return None


def fsdp_reduce_specs(shardings):
    """(in_specs, out_specs) of the reduce-scatter over fsdp, a shard_map manual over every within-replica axis:
    in, each device's unreduced gradient stacked over fsdp (`per_fsdp_device`), split over the other axes like the
    parameter except on the dimension that is split over fsdp (kept whole: the device picks its block of it);
    out, the parameter's own shard (`within_replica_specs`)."""
    inside = set(mesh_lib.WITHIN_REPLICA_AXES)

    def unreduced(s):
        fsdp = mesh_lib.axis_name(s.mesh, mesh_lib.FSDP_AXIS)
        split = fsdp_split(s)
        kept = _drop_axes(s.spec, lambda a: a in inside and a != fsdp)
        entries = [None if split is not None and d == split[0] else e for d, e in enumerate(kept)]
        return P(fsdp, *entries)

    return (jax.tree.map(unreduced, shardings, is_leaf=_is_sharding), within_replica_specs(shardings))


def stacked(shardings, over_replicas: bool = True):
    """The shardings of a stack of copies along a new leading dimension: over the replica axis (per-replica
    copies), or unsplit (a buffer of versions); the other dimensions as before."""
    lead = mesh_lib.REPLICA_AXIS if over_replicas else None
    return jax.tree.map(lambda s: NamedSharding(s.mesh, P(lead, *s.spec)), shardings, is_leaf=_is_sharding)


def replicated_specs(tree):
    """`REPLICATED` for every leaf of `tree` (e.g. a communicator's state in a shard_map)."""
    return jax.tree.map(lambda _: REPLICATED, tree)


COMM_OWN = "own"  # a compressed communicator's per-replica part (jaxpar.parallel.compression.OWN)


def _split_comm(state):
    """(the per-replica part, if `state` is a compressed communicator's with a non-empty one, else None)."""
    if isinstance(state, dict) and COMM_OWN in state and jax.tree.leaves(state[COMM_OWN]):
        return state[COMM_OWN]
    return None


def communicator_shardings(abstract_state, param_shardings, mesh: Mesh):
    """A communicator's state: its per-replica part (params-shaped, e.g. error-feedback residuals) stacked over the
    replicas like per-replica parameters; everything else replicated."""
    out = jax.tree.map(lambda _: replicated(mesh), abstract_state)
    if _split_comm(abstract_state) is not None:
        out[COMM_OWN] = stacked(param_shardings)
    return out


def communicator_specs(state, param_shardings=None):
    """Specs of a communicator's state in a replica-manual shard_map (the per-replica part: `PER_REPLICA`), or,
    with `param_shardings`, in the nested shard_map manual over the within-replica axes (the per-replica part:
    its leading dimension whole, the rest like the parameters' shards)."""
    out = replicated_specs(state)
    if _split_comm(state) is not None:
        out[COMM_OWN] = (jax.tree.map(lambda _: PER_REPLICA, state[COMM_OWN]) if param_shardings is None else
                         jax.tree.map(lambda s: P(None, *s), within_replica_specs(param_shardings),
                                      is_leaf=lambda x: isinstance(x, P)))
    return out


def specs_of(shardings) -> list:
    """The PartitionSpec of each NamedSharding leaf, in tree order."""
    return [s.spec for s in jax.tree.leaves(shardings, is_leaf=_is_sharding)]


def split_axes(spec) -> set:
    """The mesh axes a spec splits some dimension over."""
    return {a for entry in spec for a in _entry_axes(entry)}


def device_grid_spec(mesh: Mesh) -> P:
    """One entry per device along every mesh axis (a per-device result gathered as [*mesh.shape, ...])."""
    return P(*mesh.axis_names)


def leading_over_devices(mesh: Mesh) -> NamedSharding:
    """The leading dimension split over every device of the mesh jointly: one block per device (calibration's
    per-device buffers)."""
    return NamedSharding(mesh, P(tuple(mesh.axis_names)))


def replicate_within(tree):
    """Inside a replica-manual shard_map: every leaf whole on each of the replica's devices."""
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, REPLICATED), tree)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, REPLICATED)


def batch_spec(leading=(), mesh=None) -> P:
    """Examples over the batch axes (by `mesh`'s names, if given); `leading` unsplit dimensions in front (e.g. a
    microbatch axis)."""
    if mesh is None:
        return P(*leading, mesh_lib.BATCH_AXES)
    axes = mesh_lib.axis_names(mesh, mesh_lib.BATCH_AXES)
    if mesh_lib.is_explicit(mesh):  # a sharding is part of an Explicit array's type: axes of size 1 would show in it
        axes = tuple(a for a in axes if mesh.shape[a] > 1)
    return P(*leading, axes[0] if len(axes) == 1 else (axes or None))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (example) dimension split over the batch axes, everything else replicated."""
    return NamedSharding(mesh, batch_spec(mesh=mesh))


def restore_sharding(mesh: Mesh, like: NamedSharding | None, stacked_copy: bool = False) -> NamedSharding:
    """Where to read a saved array: like the strategy-free leaf it is (`like`), or a stack of such leaves with an
    unsplit leading dimension (`stacked_copy`), or whole (`like` None)."""
    if like is None:
        return replicated(mesh)
    return NamedSharding(mesh, P(None, *like.spec)) if stacked_copy else like


def bytes_per_device(abstract_tree, shardings) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs placed by `shardings` (the largest device's share)."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(
            shardings, is_leaf=lambda x: isinstance(x, NamedSharding))):
        total += math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total


# --- pipeline stages ---------------------------------------------------------------------------------------------
STAGE_SPLIT = P(mesh_lib.STAGE_AXIS)  # a leading dimension split over the stages (each holds its run of layers)


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
