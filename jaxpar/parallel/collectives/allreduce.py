"""The mean, sum and gather of every leaf of a tree over a manual mesh axis, by algorithm: XLA's own collectives
(psum) or the hand-written ones (`rings`), fused into one flat buffer per dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.parallel.collectives.algorithms import check_algorithm, torus_shape
from jaxpar.parallel.collectives.buffers import per_flat_buffer
from jaxpar.parallel.collectives.rings import gather_leaf, ps_mean, ps_pull, ps_push, shifted_all_to_all, torus_sum


def _fused_mean(leaves, axis_name, n, algorithm, torus, average=True):
    """A hand-written algorithm's mean (or sum) of every leaf, one flat buffer per dtype."""
    def mean_of_flat(flat, dtype):
        size = flat.shape[0]
        if size == 0:
            return flat
        if algorithm == "ps":
            return ps_mean(flat, axis_name, n, average)
        flat = jnp.pad(flat, (0, -size % n))  # every device must own an equal 1/N slice
        x, y = torus if algorithm == "torus2d" else (1, n)
        total = torus_sum(flat, axis_name, n, x, y)
        return (total / jnp.asarray(n, dtype) if average else total)[:size]

    return per_flat_buffer(leaves, mean_of_flat)


def allreduce_mean(tree, axis_name: str, algorithm: str = "psum", *, torus_x: int | None = None):
    """Mean of every leaf of `tree` over the manual mesh axis `axis_name`, by `algorithm`.

    Call inside a `jax.shard_map` body where `axis_name` is manual. Leaves must be floating point (gradients);
    sums accumulate in the leaf dtype, and the mean is sum / N, as `lax.pmean` does.
    """
    check_algorithm(algorithm)
    leaves, treedef = jax.tree.flatten(tree)
    for leaf in leaves:
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise TypeError(f"allreduce_mean averages floating-point leaves, got a {leaf.dtype} leaf {leaf.shape}")
    n = lax.axis_size(axis_name)
    torus = torus_shape(n, torus_x) if algorithm == "torus2d" else None
    if algorithm == "psum":
        return lax.pmean(tree, axis_name)
    if n == 1 or not leaves:
        return tree
    return jax.tree.unflatten(treedef, _fused_mean(leaves, axis_name, n, algorithm, torus))


def allreduce_sum(tree, axis_name: str, algorithm: str = "psum", *, torus_x: int | None = None):
    """Like `allreduce_mean`, the sum (in the leaves' dtype): what a codec's wire format is summed with."""
    check_algorithm(algorithm)
    leaves, treedef = jax.tree.flatten(tree)
    n = lax.axis_size(axis_name)
    if n == 1 or not leaves:
        return tree
    if algorithm == "psum" and all(jnp.dtype(x.dtype).itemsize == 2 for x in leaves):
        return jax.tree.unflatten(treedef, _native_sum_16(leaves, axis_name, n))
    if algorithm == "psum":
        return lax.psum(tree, axis_name)
    torus = torus_shape(n, torus_x) if algorithm == "torus2d" else None
    return jax.tree.unflatten(treedef, _fused_mean(leaves, axis_name, n, algorithm, torus, average=False))


def _native_sum_16(leaves, axis_name, n):
    """The sum of 16-bit float leaves with 16 bits on the wire, by XLA's own collectives.

    XLA:CPU promotes a 16-bit all-reduce or reduce-scatter to float32 (its AllReducePromotion pass: 4 bytes per
    element on the wire), so the reduce-scatter is an all-to-all of the (bitcast) 16-bit chunks, each device sums
    its chunk over the replicas in float32 and rounds it once to 16 bits, and an all-gather shares the chunks:
    2(N-1)/N x 2 bytes per element, like a ring all-reduce of the 16-bit buffer."""
    dtype = jnp.dtype(leaves[0].dtype)
    flat = jnp.concatenate([jnp.ravel(x.astype(dtype)) for x in leaves])
    size = flat.shape[0]
    chunks = jnp.pad(flat, (0, -size % n)).reshape(n, -1)
    bits = lax.all_to_all(lax.bitcast_convert_type(chunks, jnp.uint16), axis_name, 0, 0)  # row i: from device i
    own = jnp.sum(lax.bitcast_convert_type(bits, dtype).astype(jnp.float32), axis=0).astype(dtype)
    whole = lax.all_gather(lax.bitcast_convert_type(own, jnp.uint16), axis_name)
    flat = lax.bitcast_convert_type(whole, dtype).reshape(-1)[:size]
    out, offset = [], 0
    for x in leaves:
        out.append(flat[offset:offset + x.size].reshape(x.shape).astype(x.dtype))
        offset += x.size
    return out


def allgather(tree, axis_name: str, algorithm: str = "psum", *, torus_x: int | None = None):
    """Every leaf stacked over the axis ([N, ...], entry i from device i): psum -> XLA's all-gather; ring -> N-1
    ppermute steps; torus2d -> gathered along X, then the X-stacks along Y; ps -> through device 0."""
    check_algorithm(algorithm)
    n = lax.axis_size(axis_name)
    if algorithm == "psum":
        return lax.all_gather(tree, axis_name)
    if n == 1:
        return jax.tree.map(lambda x: x[None], tree)
    torus = torus_shape(n, torus_x) if algorithm == "torus2d" else None
    return jax.tree.map(lambda x: gather_leaf(x, axis_name, n, algorithm, torus), tree)


def all_to_all(tree, axis_name: str, algorithm: str = "psum"):
    """Every leaf [N, ...]: row j goes to device j; returns [N, ...] with row i from device i. psum -> XLA's
    all-to-all; ring / torus2d -> N-1 ppermutes (`rings.shifted_all_to_all`); ps has none (it pushes and pulls)."""
    check_algorithm(algorithm)
    n = lax.axis_size(axis_name)
    if n == 1:
        return tree
    if algorithm == "psum":
        return jax.tree.map(lambda x: lax.all_to_all(x, axis_name, 0, 0), tree)
    if algorithm == "ps":
        raise ValueError("the parameter server has no all-to-all: push to device 0, pull from it")
    return jax.tree.map(lambda x: shifted_all_to_all(x, axis_name, n), tree)


def push(tree, axis_name: str):
    """The parameter server's push: every leaf stacked [N, ...] on device 0 (entry i from device i)."""
    n = lax.axis_size(axis_name)
    return jax.tree.map(lambda x: ps_push(x, axis_name, n) if n > 1 else x[None], tree)


def pull(tree, axis_name: str):
    """The parameter server's pull: device 0's leaves on every device."""
    n = lax.axis_size(axis_name)
    return jax.tree.map(lambda x: ps_pull(x, axis_name, n) if n > 1 else x, tree)
