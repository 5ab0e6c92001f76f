"""Random draws of a shard of rows that equal the same rows of the whole array's draw.

Inside a stage map that is manual over data, each device holds only its rows of every microbatch, and a block's
dropout draws a mask of that local shape. With JAX's threefry (`jax_threefry_partitionable`, the default) the bits
of element i of a draw are `threefry(key, i)`, i its flat index in the drawn array: the whole microbatch's mask
and a shard's local mask differ only in where the flat index starts. A key of this module's PRNG carries the
shard's first row and draws the bits of the whole array at those rows, so the masks (and the losses) stay the same
on every mesh without computing anything more than the local draw.

A draw is taken as one over rows when its first dimension is the shard's row count (a block's dropout on its
activations); any other draw (e.g. a mask broadcast over the rows, first dimension 1) is the same on every shard,
as it is for the whole array.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import random as jex_random

from jaxpar.errors import ModelError


def _split32(x):
    """(high 16 bits, low 16 bits) of uint32 `x`."""
    return x >> 16, x & 0xFFFF


def _offset_counts(first_row, per_row: int, shape, stride: int = 1):
    """The 64-bit flat indices (high, low uint32 arrays of `shape`) of a local array of `shape` whose row r is row
    `first_row + r * stride` of the whole array: (first_row + r * stride) * per_row + j, with carries."""
    if shape and shape[0] * stride * per_row >= 2 ** 32:
        raise ModelError(f"a random draw of shape {shape} (every {stride}th row of the batch) inside a pipeline "
                         f"stage: the batch's draw spans more than 2**32 elements; use fewer rows per device")
    local = lax.broadcasted_iota(jnp.uint32, shape, 0) * np.uint32(per_row * stride)  # r * stride * per_row
    if len(shape) > 1:
        local = local + (lax.iota(jnp.uint32, per_row).reshape(shape[1:]))
    # first_row * per_row as 64 bits from 16-bit halves (each partial product fits 32 bits)
    a_hi, a_lo = _split32(jnp.asarray(first_row, jnp.uint32))
    b_hi, b_lo = np.uint32(per_row >> 16), np.uint32(per_row & 0xFFFF)
    low = a_lo * b_lo
    mid_1, mid_2 = a_hi * b_lo, a_lo * b_hi
    mid = mid_1 + mid_2
    mid_carry = (mid < mid_1).astype(jnp.uint32)
    base_lo = low + (mid << 16)
    high = a_hi * b_hi + (mid >> 16) + (mid_carry << 16) + (base_lo < low).astype(jnp.uint32)
    counts_lo = base_lo + local
    counts_hi = high + (counts_lo < local).astype(jnp.uint32)
    return jnp.broadcast_to(counts_hi, shape), counts_lo


def _threefry_key(data):
    return jax.random.wrap_key_data(data[:2], impl="threefry2x32")


@functools.lru_cache(maxsize=None)
def _impl(rows: int, stride: int = 1):
    """The PRNG of a shard of `rows` rows, every `stride`th row of the whole array: key data (k1, k2, first row)."""

    def carry(data, threefry):
        return jnp.concatenate([jax.random.key_data(threefry), data[2:]])

    def seed(_):
        raise NotImplementedError("jaxpar.pipeline.shard_keys: make a key with shard_key, not a seed")

    def split(data, shape):
        keys = jax.random.key_data(jax.random.split(_threefry_key(data), shape))
        return jnp.concatenate([keys, jnp.broadcast_to(data[2:], shape + (1,))], axis=-1)

    def fold_in(data, value):
        return carry(data, jax.random.fold_in(_threefry_key(data), value))

    def random_bits(data, bit_width, shape):
        if math.prod(shape) >= 2 ** 32:
            raise ModelError(f"a random draw of shape {shape} inside a pipeline stage: more than 2**32 elements "
                             f"per device; use more data shards or microbatches")
        if shape and shape[0] == rows:
            counts_hi, counts_lo = _offset_counts(data[2], math.prod(shape[1:]), shape, stride)
        else:  # not over the rows: the whole array's draw, the same on every shard
            counts_hi, counts_lo = _offset_counts(np.uint32(0), math.prod(shape[1:]), shape)
        bits_1, bits_2 = jex_random.threefry2x32_p.bind(data[0], data[1], counts_hi, counts_lo)
        if bit_width == 64:
            return (bits_1.astype(jnp.uint64) << 32) | bits_2.astype(jnp.uint64)
        bits = bits_1 ^ bits_2
        return bits if bit_width == 32 else bits.astype({8: jnp.uint8, 16: jnp.uint16}[bit_width])

    return jex_random.define_prng_impl(key_shape=(3,), seed=seed, split=split, random_bits=random_bits,
                                       fold_in=fold_in, name=f"jaxpar_shard_rows_{rows}_{stride}",
                                       tag=f"shard{rows}x{stride}")


def shard_key(key, first_row, rows: int, stride: int = 1):
    """`key` (a typed threefry key) as the key of a shard of `rows` rows: rows `first_row`, `first_row + stride`,
    ... of the whole array (a microbatch's rows when `stride` is the microbatch count); its draws over rows are the
    whole array's draws at those rows."""
    if not jax.config.jax_threefry_partitionable:
        raise ModelError("dropout in a pipeline stage with data > 1 needs jax_threefry_partitionable (JAX's default) "
                         "so that each data shard can draw its rows of the whole batch's masks; set "
                         "jax.config.update('jax_threefry_partitionable', True)")
    data = jnp.concatenate([jax.random.key_data(key), jnp.asarray(first_row, jnp.uint32)[None]])
    return jax.random.wrap_key_data(data, impl=_impl(rows, stride))
