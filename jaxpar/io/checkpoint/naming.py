"""A train state as a flat dict of named arrays, and the description (shape, dtype) a checkpoint's metadata keeps."""

from __future__ import annotations

import jax
import numpy as np

from jaxpar.names import named_leaves


def is_key(x) -> bool:
    """A typed PRNG key (stored as its raw key data)."""
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def flatten(tree) -> tuple[dict, list[str], object]:
    """(name -> leaf, names in tree order, treedef); names from `jaxpar.names`; typed PRNG keys stay typed here."""
    named = named_leaves(tree)
    names = [name for name, _ in named]
    return dict(named), names, jax.tree_util.tree_structure(tree)


def strategy_name(strategy) -> str:
    return getattr(strategy, "name", type(strategy).__name__)


def describe(flat: dict) -> dict:
    """name -> {"shape", "dtype"} of what is stored (a typed key: its uint32 key data, and its `key_impl`)."""
    out = {}
    for name, x in flat.items():
        if is_key(x):
            out[name] = {"shape": list(jax.eval_shape(jax.random.key_data, x).shape), "dtype": "uint32",
                         "key_impl": str(jax.random.key_impl(x)) if isinstance(x, jax.Array) else None}
        else:
            out[name] = {"shape": list(x.shape), "dtype": str(np.dtype(x.dtype))}
    return out


def shapes(described: dict) -> dict:
    return {n: (tuple(d["shape"]), d["dtype"]) for n, d in described.items()}


def stored(x):
    """The abstract array orbax restores for target leaf `x` (typed keys are stored as their key data)."""
    if is_key(x):
        data = jax.eval_shape(jax.random.key_data, x)
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=x.sharding)
    return x


def wrap(value, target, described: dict):
    """A stored array as the leaf `target` is: key data back into a typed key (with the saved implementation)."""
    if is_key(target):
        impl = described.get("key_impl") or str(jax.random.key_impl(jax.random.key(0)))
        return jax.random.wrap_key_data(value, impl=impl)
    return value


def first_line(error: BaseException) -> str:
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text[:240]}"
