"""All-gather and Ulysses attention: the two algorithms that give each device whole sequences to attend over.

- all-gather (MaxText's default): K and V gathered over the seq axis once per layer; each device attends its own
  query block over every key. Traffic (S-1)/S of the layer's K and V per device; memory O(L) for K/V.
- Ulysses (DeepSpeed): an all-to-all turns [B, L/S, H, K] (sequence split) into [B, L, H/S, K] (heads split),
  every device attends whole sequences on its H/S heads, and a second all-to-all turns the output back. Traffic
  (S-1)/S of q, k, v and the output, i.e. 4 activations' worth, independent of nothing but L x H x K / S.
Both run inside a map manual over the seq axis, on contiguous blocks.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxpar.parallel.context import blocks


def allgather_attention(q, k, v, axis: str, ways: int, causal: bool, scale: float):
    block = q.shape[1]
    k_all = lax.all_gather(k, axis, axis=1, tiled=True)
    v_all = lax.all_gather(v, axis, axis=1, tiled=True)
    q_pos = lax.axis_index(axis) * block + jnp.arange(block)
    return blocks.attend(q, k_all, v_all, q_pos, jnp.arange(block * ways), causal, scale)


def ulysses_attention(q, k, v, axis: str, ways: int, causal: bool, scale: float):
    def to_heads(x):  # [B, L/S, H, K] -> [B, L, H/S, K]
        return lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    positions = jnp.arange(q.shape[1])
    out = blocks.attend(q, k, v, positions, positions, causal, scale)
    return lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)  # back to [B, L/S, H, K]
