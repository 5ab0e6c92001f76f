"""Restore onto a trainer's mesh and strategy: directly when the state carries over, else through the
strategy-free state (the saved strategy's `reduce`, then the trainer's `expand`).

The checkpoint code knows no strategy: it reads the saved arrays, nests them by name into the saved strategy's
tree (a `TrainState` whose fields are dicts keyed by the rest of the name; `strategy_state` holds named parts one
level deeper), and asks `jaxpar.strategies.REGISTRY[meta["strategy"]]` to reduce it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import CheckpointError
from jaxpar.io.checkpoint.naming import describe, flatten, shapes, strategy_name, stored, wrap
from jaxpar.io.checkpoint.strategy_notes import notes_of
from jaxpar.parallel import partitioning

NESTED_FIELDS = ("strategy_state",)  # TrainState fields that hold a dict of named parts (strategies/base.py)
# TrainState fields whose saved leaves this trainer lacks are dropped, not refused (as before the reshape: e.g. a
# learning-rate schedule's count saved by run.py's optimizer, restored with a constant-rate one)
DROPPED_IF_EXTRA = ("opt_state",)
STACKED_NOTE = ("its per-layer arrays ({old}, ...) were stacked into the layout of this model's stacked blocks "
                "({new}, ...)")  # an unstacked model's checkpoint (see stack_layers)


def restore_state(checkpoints, step: int, meta: dict, trainer) -> tuple[object, list[str]]:
    """(the train state of `trainer`, notes) from the checkpoint of `step` (its metadata `meta`)."""
    saved = meta["leaves"]
    target = trainer.abstract_state()
    flat, names, treedef = flatten(target)
    same_strategy = meta.get("strategy") == strategy_name(trainer.strategy)
    if same_strategy and shapes(saved) == shapes(describe(flat)):  # the fast path: read as it is
        arrays = checkpoints.read(step, {n: stored(x) for n, x in flat.items()})
        return jax.tree_util.tree_unflatten(treedef, [wrap(arrays[n], flat[n], saved[n]) for n in names]), []
    return _through_neutral(checkpoints, step, meta, trainer, same_strategy)


def _through_neutral(checkpoints, step: int, meta: dict, trainer, same_strategy: bool):
    from jaxpar.strategies import REGISTRY  # (the strategies import the trainer's modules)

    saved = meta["leaves"]
    neutral = trainer.abstract_state(neutral=True)
    flat, names, treedef = flatten(neutral)
    wanted = describe(flat)
    index = suffix_index(flat)
    raw = checkpoints.read(step, {n: jax.ShapeDtypeStruct(tuple(d["shape"]), jnp.dtype(d["dtype"]),
                                                          sharding=placement(n, d["shape"], flat, wanted, index,
                                                                             trainer.mesh))
                                  for n, d in saved.items()})
    # the strategy that wrote it reduces it: this trainer's own (a strategy of the user's too), or a built-in one
    written_by = type(trainer.strategy) if same_strategy else REGISTRY.get(meta.get("strategy"))
    nested, problems = nest(raw, type(neutral))
    if written_by is not None:
        try:
            reduced = written_by.reduce(nested)
        except (KeyError, ValueError, TypeError) as error:  # parts missing or of mismatched shapes
            reduced = None
            problems.append(f"its arrays do not form a {written_by.name} state ({type(error).__name__}: {error})")
    else:
        reduced = nested
        if any(n.split(".")[0] in NESTED_FIELDS for n in saved):
            problems.append(f"it holds the state of strategy {meta.get('strategy')!r}, which this jaxpar does not "
                            f"know")
    values = unnest(reduced) if reduced is not None else {}
    values, stacked = stack_layers(values, wanted)
    values, regrouped = regroup_replicas(values, wanted)
    if reduced is not None:
        for name in names:
            if name not in values:
                problems.append(f"{name} is not in the checkpoint")
                continue
            value = values[name]
            shape, dtype = list(value.shape), str(np.dtype(value.dtype))
            if shape != wanted[name]["shape"] or dtype != wanted[name]["dtype"]:
                problems.append(f"{name}: checkpoint {dtype}{shape}, this model "
                                f"{wanted[name]['dtype']}{wanted[name]['shape']}")
        extra = sorted(n for n in set(values) - set(names) if n.split(".")[0] not in DROPPED_IF_EXTRA
                       and not (stacked and _is_rng_stream(n)))
        problems += [f"{n} is in the checkpoint but not in this model" for n in extra[:3]]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(checkpoints.directory, f"the checkpoint of step {step} is of another model or "
                                                     f"optimizer ({shown}); restore it with the model, optimizer "
                                                     f"and config that wrote it, or use another folder")
    leaves = [jax.device_put(wrap(values[n], flat[n], saved.get(n, {})), flat[n].sharding) for n in names]
    state = trainer.expand(jax.tree_util.tree_unflatten(treedef, leaves))
    restore_notes = notes_of(written_by)
    if same_strategy:  # e.g. DiLoCo's outer optimizer state: independent of the replica count, carried over
        for field in restore_notes.kept:
            state = _carry(state, field, raw, saved)
    how = restore_notes.note.format(replicas=meta.get("replicas"))
    before = f"{meta.get('strategy')} on {meta.get('replicas')} replicas"
    now = f"{strategy_name(trainer.strategy)} on {trainer.num_replicas} replicas"
    fresh = "" if same_strategy else "; strategy state of the new strategy starts fresh"
    notes = [f"checkpoint step {step} was written by {before}; this run is {now}: {how}{fresh}"]
    if stacked:
        notes.append(STACKED_NOTE.format(old=stacked[0][1], new=stacked[0][0]))
    if regrouped:
        notes.append(REGROUPED_NOTE.format(old=regrouped[0], new=regrouped[1]))
    return state, notes


REGROUPED_NOTE = ("the communicator's per-replica state (error-feedback residuals) of {old} replicas was averaged "
                  "(int8's shard-owner residuals summed) and given to each of the {new} replicas: what the next "
                  "averaged gradient receives is kept")
# int8's shard-owner residuals: each replica holds the elements it owns (zeros elsewhere), so their sum is the whole
OWNER_RESIDUALS = f"comm_state.{partitioning.COMM_OWN}.owner."


def regroup_replicas(values: dict, wanted: dict) -> tuple[dict, tuple]:
    """(`values` with every `comm_state` array saved with another leading (replica) dimension than this trainer's
    averaged over it (int8's owner residuals: summed) and broadcast to this trainer's, (saved replicas, new
    replicas) or ())."""
    out, regrouped = dict(values), ()
    for name, described in wanted.items():
        shape = list(described["shape"])
        value = out.get(name)
        if not name.startswith("comm_state.") or value is None or not shape or list(value.shape) == shape:
            continue
        if list(value.shape[1:]) == shape[1:]:
            combine = jnp.sum if name.startswith(OWNER_RESIDUALS) else jnp.mean
            mean = combine(jnp.asarray(value, jnp.float32), axis=0).astype(value.dtype)
            out[name] = jnp.broadcast_to(mean, shape)
            regrouped = (value.shape[0], shape[0])
    return out, regrouped


def stack_layers(values: dict, wanted: dict) -> tuple[dict, list[tuple[str, str]]]:
    """(`values` with the per-layer arrays of an unstacked model stacked, [(stacked name, its first source)]).

    A name this model wants with a `layers` part (`params.blocks.layers.up.kernel.value`: a stack of blocks,
    `jaxpar.pipeline.Stack`) that `values` lacks is built from `params.blocks.0.up.kernel.value`,
    `params.blocks.1...`, ... (a list of blocks, as the built-in transformer had before issue 19), one per layer of
    its leading dimension, if all are there with the shape of one layer; the per-layer names are removed."""
    out, stacked = dict(values), []
    for name, described in wanted.items():
        parts, shape = name.split("."), list(described["shape"])
        if name in out or partitioning.LAYERS not in parts or not shape:
            continue
        at = parts.index(partitioning.LAYERS)
        sources = [".".join(parts[:at] + [str(layer)] + parts[at + 1:]) for layer in range(shape[0])]
        if all(s in out and list(out[s].shape) == shape[1:] for s in sources):
            out[name] = jnp.stack([out.pop(s) for s in sources])
            stacked.append((name, sources[0]))
    return out, stacked


def _is_rng_stream(name: str) -> bool:
    """A dropout RNG stream a module kept in the model state (`model_state.blocks.0.dropout.rngs.key.value`): an
    unstacked model's, which a stacked model with call-time rngs does not keep."""
    parts = name.split(".")
    return parts[0] == "model_state" and any(a == "rngs" and b in ("key", "count") for a, b in zip(parts, parts[1:]))


def placement(name: str, shape: list, flat: dict, wanted: dict, index: dict, mesh):
    """Where to read a saved array on the new mesh, so no device holds more than it will: like the strategy-free
    leaf whose name (without its field) the saved name ends with and whose shape it has; with one extra leading
    dimension (a stack of copies or versions), like it with that dimension unsplit; whole if nothing matches.
    The longest matching name wins. `index`: `suffix_index(flat)`."""
    parts, shape = name.split("."), list(shape)
    for start in range(len(parts)):
        for base in index.get(".".join(parts[start:]), ()):
            if shape == wanted[base]["shape"]:
                return partitioning.restore_sharding(mesh, flat[base].sharding)
            if len(shape) == len(wanted[base]["shape"]) + 1 and shape[1:] == wanted[base]["shape"]:
                return partitioning.restore_sharding(mesh, flat[base].sharding, stacked_copy=True)
    return partitioning.restore_sharding(mesh, None)


def suffix_index(flat: dict) -> dict:
    """A strategy-free name without its field (the whole name for a field that is one leaf) -> the names so."""
    index: dict = {}
    for name in flat:
        field, _, rest = name.partition(".")
        index.setdefault(rest or field, []).append(name)
    return index


def _carry(state, field: str, raw: dict, saved: dict):
    """`state` with its `field` read from the checkpoint, if the checkpoint has every leaf of it in the same
    shape and dtype (else `state` as it is)."""
    flat, names, treedef = flatten(getattr(state, field))
    if not names:
        return state
    described = describe(flat)
    full = {n: f"{field}.{n}" for n in names}
    if not all(full[n] in saved and shapes({0: saved[full[n]]}) == shapes({0: described[n]}) for n in names):
        return state
    leaves = [jax.device_put(wrap(raw[full[n]], flat[n], saved[full[n]]), flat[n].sharding) for n in names]
    return state._replace(**{field: jax.tree_util.tree_unflatten(treedef, leaves)})


class _Parts(dict):
    """A nested field's named parts; a part the checkpoint holds no array of is empty."""

    def __missing__(self, part):
        return {}


def nest(arrays: dict, state_type) -> tuple[object, list[str]]:
    """(`state_type` whose fields are dicts keyed by the rest of each array's name (a field that is one array: that
    array; `NESTED_FIELDS`: one level deeper, by part), problems: names of no field)."""
    fields = {f: (_Parts() if f in NESTED_FIELDS else {}) for f in state_type._fields}
    problems = []
    for name, value in arrays.items():
        field, _, rest = name.partition(".")
        if field not in fields:
            problems.append(f"{name} is in the checkpoint but not in this model")
        elif not rest:
            fields[field] = value
        elif field in NESTED_FIELDS:
            part, _, key = rest.partition(".")
            if key:
                fields[field].setdefault(part, {})[key] = value
            else:
                fields[field][part] = value
        else:
            fields[field][rest] = value
    return state_type(**fields), problems


def unnest(state) -> dict:
    """The inverse of `nest`: name -> array of every leaf of a (reduced) state."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, (tuple, list)):
            for index, item in enumerate(value):
                walk(f"{prefix}.{index}", item)
        elif value is not None:
            out[prefix] = value

    for field in state._fields:
        walk(field, getattr(state, field))
    return out
