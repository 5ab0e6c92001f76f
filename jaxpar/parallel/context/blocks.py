"""Attention on blocks of a sequence, by global positions: the plain softmax, and the online softmax (running max,
denominator and output) that merges key blocks one at a time (Milakov & Gimelshein; the ring's inner step).

Shapes: q [B, Lq, H, K], k and v [B, Lk, H, K], positions [Lq] and [Lk] (global, whatever block they came from); the
scores and the softmax in float32, the output in v's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # a masked score (finite: the online softmax subtracts maxima that may still be "empty")


def scores(q, k, q_pos, k_pos, causal: bool, scale: float):
    """(scores [B, H, Lq, Lk] in float32, mask [Lq, Lk]: which keys each query may see)."""
    s = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32) * scale
    mask = (k_pos[None, :] <= q_pos[:, None]) if causal else jnp.ones((q.shape[1], k.shape[1]), bool)
    return jnp.where(mask, s, _MASKED), mask


def attend(q, k, v, q_pos, k_pos, causal: bool, scale: float):
    """softmax(q k^T x scale, masked by positions) v: every key at once."""
    s, _ = scores(q, k, q_pos, k_pos, causal, scale)
    probs = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", probs, v)


def empty(q):
    """The online softmax's state before any key: (max [B, H, Lq], denominator [B, H, Lq], output [B, Lq, H, K])."""
    b, lq, h, kd = q.shape
    return (jnp.full((b, h, lq), _MASKED, jnp.float32), jnp.zeros((b, h, lq), jnp.float32),
            jnp.zeros((b, lq, h, kd), jnp.float32))


def merge(state, q, k, v, q_pos, k_pos, causal: bool, scale: float):
    """`state` after the keys `k` (values `v`) too."""
    m, denom, out = state
    s, mask = scores(q, k, q_pos, k_pos, causal, scale)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)  # masked keys weigh 0 even while a row has seen none
    correction = jnp.exp(m - m_new)
    denom = denom * correction + p.sum(-1)
    out = out * correction.transpose(0, 2, 1)[..., None] + jnp.einsum("bhqs,bshk->bqhk", p, v.astype(jnp.float32))
    return m_new, denom, out


def finish(state, dtype):
    _, denom, out = state
    return (out / denom.transpose(0, 2, 1)[..., None]).astype(dtype)
