"""The train state's shardings: each variable's names (its own, or a path rule's) -> its `NamedSharding`, and the
optimizer state laid out like the parameters it belongs to.

Names the model uses that no rule mentions are collected in the `ShardingNotes` (a typo like `mpl` must not
silently replicate a big matrix); so are the parameters the fsdp placement moved or left whole.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.names import variable_name
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.partitioning.fsdp_placement import fsdp_anywhere
from jaxpar.parallel.partitioning.rules import LAYERS, normalize_rules, spec_for
from jaxpar.parallel.partitioning.specs import REPLICATED, replicated
from jaxpar.parallel.partitioning.stages import check_stages
from jaxpar.parallel.path_rules import MeshAxes, dimension_names, match, normalize_path_rules, rule_path
from jaxpar.parallel.sharding_notes import ShardingNotes


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


def state_shardings(abstract_state, rules, mesh: Mesh, strict: bool = True, notes: ShardingNotes | None = None,
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


def optimizer_shardings(tx: optax.GradientTransformation, abstract_opt_state, param_shardings, mesh: Mesh):
    """Optimizer state leaves shaped like parameters are sharded like them; everything else is replicated."""
    return optax.tree_map_params(tx, lambda _, sharding: sharding, abstract_opt_state, param_shardings,
                                 transform_non_params=lambda _: replicated(mesh), is_leaf=is_variable)
