"""The hand-written algorithms, built from `lax.ppermute`: ring, torus2d (rings along X and Y) and the parameter
server (through device 0), as sums, means and gathers of one flat buffer or one array.

In the ring functions `chunks` is [G, C]; `pos` is this device's (traced) position in its ring of G devices; `perm`
maps every device of the axis to its successor in its own ring, so several rings (the rows or columns of a torus)
run in the same ppermute.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def permute(x, axis_name, perm):
    """`lax.ppermute`, with a 16-bit float sent as its bits: XLA:CPU otherwise moves the permute of a bfloat16
    value that an add produced to float32 (measured: a bf16 ring sent as many bytes as float32)."""
    if jnp.dtype(x.dtype).itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):
        bits = lax.ppermute(lax.bitcast_convert_type(x, jnp.uint16), axis_name, perm)
        return lax.bitcast_convert_type(bits, x.dtype)
    return lax.ppermute(x, axis_name, perm)


def ring_reduce_scatter(chunks, axis_name, pos, perm):
    """After G-1 steps, device `pos` holds chunk (pos+1) % G summed over its ring; returns that chunk."""
    g = chunks.shape[0]
    for s in range(g - 1):
        received = permute(lax.dynamic_index_in_dim(chunks, (pos - s) % g, keepdims=False), axis_name, perm)
        k = (pos - s - 1) % g
        chunks = lax.dynamic_update_index_in_dim(chunks, lax.dynamic_index_in_dim(chunks, k, 0, False) + received, k, 0)
    return lax.dynamic_index_in_dim(chunks, (pos + 1) % g, keepdims=False)


def ring_all_gather(chunk, out, axis_name, pos, perm):
    """Inverse layout of `ring_reduce_scatter`: every device ends with all G chunks (written into `out`)."""
    g = out.shape[0]
    out = lax.dynamic_update_index_in_dim(out, chunk, (pos + 1) % g, 0)
    for s in range(g - 1):
        chunk = permute(chunk, axis_name, perm)  # the left neighbour's chunk from the previous step
        out = lax.dynamic_update_index_in_dim(out, chunk, (pos - s) % g, 0)
    return out


def ring_allreduce_sum(chunks, axis_name, pos, perm):
    if chunks.shape[0] == 1:
        return chunks
    return ring_all_gather(ring_reduce_scatter(chunks, axis_name, pos, perm), chunks, axis_name, pos, perm)


def torus_sum(flat, axis_name, n, x, y):
    """Sum of `flat` (length divisible by n = x*y) over the axis, on an x-by-y torus."""
    idx = lax.axis_index(axis_name)
    col, row = idx % x, idx // x
    row_perm = [(r * x + c, r * x + (c + 1) % x) for r in range(y) for c in range(x)]
    col_perm = [(r * x + c, ((r + 1) % y) * x + c) for r in range(y) for c in range(x)]
    row_chunks = flat.reshape(x, -1)
    part = ring_reduce_scatter(row_chunks, axis_name, col, row_perm) if x > 1 else row_chunks[0]
    # Devices in one column all hold the same chunk index, so the Y-ring reduces like with like.
    part = ring_allreduce_sum(part.reshape(y, -1), axis_name, row, col_perm).reshape(-1)
    if x == 1:
        return part
    return ring_all_gather(part, row_chunks, axis_name, col, row_perm).reshape(-1)


def ps_mean(flat, axis_name, n, average=True):
    """Device 0 gathers, averages (or sums) and sends back; a ppermute permutation is one-to-one, hence one per
    peer."""
    idx = lax.axis_index(axis_name)
    total = flat
    for sender in range(1, n):
        total = total + permute(flat, axis_name, [(sender, 0)])  # zeros everywhere but on device 0
    mean = total / jnp.asarray(n, flat.dtype) if average else total
    received = jnp.zeros_like(mean)
    for receiver in range(1, n):
        received = received + permute(mean, axis_name, [(0, receiver)])
    return jnp.where(idx == 0, mean, received)


def ring_gather(x, axis_name, pos, perm, g):
    """[G, ...]: every member of this device's ring of G (successor map `perm`) gets all G members' `x`."""
    out = lax.dynamic_update_index_in_dim(jnp.zeros((g,) + x.shape, x.dtype), x, pos, 0)
    for s in range(g - 1):
        x = permute(x, axis_name, perm)  # from the predecessor: member pos - s - 1
        out = lax.dynamic_update_index_in_dim(out, x, (pos - s - 1) % g, 0)
    return out


def ps_push(x, axis_name, n):
    """[N, ...] on device 0: every device's `x` (entry i from device i), one worker at a time; zeros elsewhere."""
    out = lax.dynamic_update_index_in_dim(jnp.zeros((n,) + x.shape, x.dtype), x, 0, 0)
    for sender in range(1, n):
        out = lax.dynamic_update_index_in_dim(out, permute(x, axis_name, [(sender, 0)]), sender, 0)
    return out


def ps_pull(x, axis_name, n):
    """Device 0's `x` on every device, sent to one worker at a time."""
    received = jnp.zeros_like(x)
    for receiver in range(1, n):
        received = received + permute(x, axis_name, [(0, receiver)])
    return jnp.where(lax.axis_index(axis_name) == 0, x, received)


def shifted_all_to_all(rows, axis_name, n):
    """`rows` [N, ...]: row j goes to device j; returns [N, ...], row i from device i. N-1 ppermutes, the s-th to
    the device s places ahead (each device sends N-1 of its N rows once)."""
    idx = lax.axis_index(axis_name)
    out = lax.dynamic_update_index_in_dim(jnp.zeros_like(rows), lax.dynamic_index_in_dim(rows, idx, 0, False), idx, 0)
    for s in range(1, n):
        got = permute(lax.dynamic_index_in_dim(rows, (idx + s) % n, 0, False), axis_name,
                      [(j, (j + s) % n) for j in range(n)])
        out = lax.dynamic_update_index_in_dim(out, got, (idx - s) % n, 0)
    return out


def gather_leaf(x, axis_name, n, algorithm, torus):
    idx = lax.axis_index(axis_name)
    if algorithm == "ps":  # everyone sends to device 0, which sends the whole stack to each worker
        return ps_pull(ps_push(x, axis_name, n), axis_name, n)
    x_size, y_size = torus if algorithm == "torus2d" else (n, 1)
    col, row = idx % x_size, idx // x_size
    row_perm = [(r * x_size + c, r * x_size + (c + 1) % x_size) for r in range(y_size) for c in range(x_size)]
    rows = ring_gather(x, axis_name, col, row_perm, x_size) if x_size > 1 else x[None]
    if y_size == 1:
        return rows
    col_perm = [(r * x_size + c, ((r + 1) % y_size) * x_size + c) for r in range(y_size) for c in range(x_size)]
    return ring_gather(rows, axis_name, row, col_perm, y_size).reshape((n,) + x.shape)  # device y*X + x
