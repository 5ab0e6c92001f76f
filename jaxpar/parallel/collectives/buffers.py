"""Tensor fusion: the leaves of one dtype as one flat buffer, reduced at once and split back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def one_buffer(leaves, dtype) -> jax.Array:
    """The leaves (of one dtype) raveled one after the other into one flat buffer.

    Written leaf by leaf (in-place updates), not with jnp.concatenate: XLA:CPU fuses the leaves' producers (e.g. a
    bias gradient's reduction) into the concatenation and evaluates them for every element of it
    (`python -m benchmarks.distributed flatten`: the MLP's gradients of one step, 14.74 ms concatenated, 4.64 ms
    written in place, 4.62 ms not flattened; docs/processes.md).
    """
    flat, offset = jnp.zeros((sum(leaf.size for leaf in leaves),), dtype), 0
    for leaf in leaves:
        flat = lax.dynamic_update_slice(flat, jnp.ravel(leaf), (offset,))
        offset += leaf.size
    return flat


def per_flat_buffer(leaves, mean_of_flat):
    """Fuse leaves per dtype into one flat buffer each, average it with `mean_of_flat(flat, dtype)`, split back;
    returns the leaves in input order."""
    out = [None] * len(leaves)
    by_dtype: dict = {}
    for i, leaf in enumerate(leaves):
        by_dtype.setdefault(jnp.dtype(leaf.dtype), []).append(i)
    for dtype, idxs in by_dtype.items():
        mean = mean_of_flat(one_buffer([leaves[i] for i in idxs], dtype), dtype)
        offset = 0
        for i in idxs:
            out[i] = mean[offset:offset + leaves[i].size].reshape(leaves[i].shape)
            offset += leaves[i].size
    return out


def allreduce_in_one_buffer(tree, axis_name: str, reduce=lax.pmean):
    """`reduce(tree, axis_name)` (`lax.pmean` by default, or `lax.psum`), sent as one flat buffer per dtype: one
    all-reduce of one array each.

    XLA combines the all-reduces of several leaves into one all-reduce of several arrays; XLA:CPU runs that as one
    gloo all-reduce per array (a TCP round trip each), so across processes the flat buffer is several times faster
    (`jaxpar.runtime.distributed.one_buffer_gradients` decides when). Only for leaves whole on each device of the
    replica (flattening a sharded leaf would all-gather it first).
    """
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, per_flat_buffer(leaves, lambda flat, dtype: reduce(flat, axis_name)))
