"""Every partitioning decision: logical axis names -> mesh axes -> `NamedSharding`.

Models name the dimensions of their parameters (`nnx.with_partitioning(init, ("embed", "mlp"))`); a rules table maps
each logical name to a mesh axis (or None = replicated). Anything a rule does not name is replicated. A rule that
names a mesh axis the mesh does not have, a parameter with two dimensions on one mesh axis, or a dimension that
does not divide by its mesh axis is a `ShardingError` naming the parameter.

    >>> spec_for(("embed", "mlp"), DEFAULT_RULES, mesh, "mlp/kernel")     # doctest: +SKIP
    PartitionSpec(None, 'model')
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.errors import ShardingError

# Megatron-style tensor parallelism: attention heads, the MLP hidden dimension and the vocabulary are split over
# `model`; embeddings and per-head dimensions are replicated.
DEFAULT_RULES: dict[str, str | None] = {
    "embed": None,
    "heads": "model",
    "kv": None,
    "mlp": "model",
    "vocab": "model",
}

Rules = Mapping[str, "str | tuple[str, ...] | None"]


def path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def validate_rules(rules: Rules, mesh: Mesh) -> None:
    for logical, target in rules.items():
        for axis in _axes_of(target):
            if axis not in mesh.axis_names:
                raise ShardingError(f"sharding rule {logical!r} -> {axis!r} names a mesh axis that does not exist; "
                                    f"mesh axes are {', '.join(mesh.axis_names)} (or None to replicate)")


def _axes_of(target) -> tuple[str, ...]:
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def spec_for(logical_names, rules: Rules, mesh: Mesh, where: str, shape=None) -> P:
    """The PartitionSpec of one array whose dimensions carry `logical_names` (None = unnamed)."""
    if logical_names is None:
        return P()
    entries, used = [], {}
    for dim, logical in enumerate(logical_names):
        target = rules.get(logical) if logical is not None else None
        axes = _axes_of(target)
        for axis in axes:  # that each axis exists is checked once, by validate_rules
            if axis in used:
                raise ShardingError(f"parameter {where}: dimensions {used[axis]} ({logical_names[used[axis]]!r}) and "
                                    f"{dim} ({logical!r}) both map to mesh axis {axis!r}; change the rules so each "
                                    f"mesh axis shards at most one dimension")
            used[axis] = dim
        if shape is not None and axes:
            ways = 1
            for axis in axes:
                ways *= mesh.shape[axis]
            if shape[dim] % ways:
                raise ShardingError(f"model dimension {logical!r} = {shape[dim]} (parameter {where}) is not divisible "
                                    f"by mesh axis {'x'.join(axes)!r} of size {ways}; choose {logical} divisible by "
                                    f"{ways} or a smaller {'x'.join(axes)} axis")
        entries.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*entries)


def logical_names_of(variable: nnx.Variable):
    meta = variable.get_metadata()
    return meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")


def is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(abstract_state, rules: Rules, mesh: Mesh):
    """NamedShardings for an (abstract) nnx.State, from each Variable's logical names and the rules."""

    def one(path, variable):
        names = logical_names_of(variable) if is_variable(variable) else None
        shape = getattr(variable, "shape", None)
        return NamedSharding(mesh, spec_for(names, rules, mesh, path_name(path), shape))

    return jax.tree_util.tree_map_with_path(one, abstract_state, is_leaf=is_variable)


def optimizer_shardings(tx: optax.GradientTransformation, abstract_opt_state, param_shardings, mesh: Mesh):
    """Optimizer state leaves shaped like parameters are sharded like them; everything else is replicated."""
    return optax.tree_map_params(tx, lambda _, sharding: sharding, abstract_opt_state, param_shardings,
                                 transform_non_params=lambda _: replicated(mesh), is_leaf=is_variable)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (example) dimension split over `data`, everything else replicated."""
    return NamedSharding(mesh, P("data"))
