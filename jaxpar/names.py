"""The one name of a pytree leaf: `params.hidden.kernel.value`, the same in checkpoints, `--explain`, errors and
reports.

A leaf's name is its tree path, each key as written (a dict key, an attribute name, a sequence index), joined by
dots; characters other than letters, digits, `_` and `-` become `_` (checkpoint file names are built from it). A
subtree is named relative to where it is taken from: `explain` names parameters from `state.params`
(`hidden.kernel.value`), a checkpoint names the whole train state (`params.hidden.kernel.value`).
"""

from __future__ import annotations

import re

import jax

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def key_text(entry) -> str:
    """One path entry as text: `DictKey('w')` -> `w`, `GetAttrKey('w')` -> `w`, `SequenceKey(0)` -> `0`."""
    return _UNSAFE.sub("_", str(getattr(entry, "name", getattr(entry, "key", getattr(entry, "idx", entry)))))


def leaf_name(path) -> str:
    """The name of the leaf at `path` (a tuple of tree-path entries, as `jax.tree_util` gives them)."""
    return ".".join(key_text(entry) for entry in path)


def variable_name(path, variable) -> str:
    """The name of the array a tree leaf at `path` holds when that leaf is itself a pytree node with one leaf (an
    `nnx.Variable`, whose array is its `value`): the name a flattened state gives that array."""
    inner = jax.tree_util.tree_flatten_with_path(variable)[0]
    return leaf_name(tuple(path) + tuple(inner[0][0])) if len(inner) == 1 else leaf_name(path)


def named_leaves(tree, is_leaf=None) -> list[tuple[str, object]]:
    """[(name, leaf)] in tree order; a name two paths share (after `_` replacement) gets `_2`, `_3`, ..."""
    out, seen = [], set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        base = name = leaf_name(path)
        suffix = 1
        while name in seen:
            suffix += 1
            name = f"{base}_{suffix}"
        seen.add(name)
        out.append((name, leaf))
    return out
