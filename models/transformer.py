"""A decoder-only transformer language model (pre-norm, learned positions, causal self-attention, GELU MLP).

Logical axes: `vocab` (embedding rows, output classes), `embed` (d_model), `heads`, `kv` (per-head dim), `mlp`
(d_ff). With the default rules, heads, d_ff and vocab are split over `model` (Megatron-style tensor parallelism):
q/k/v and the MLP's first layer are column parallel, the attention output and the MLP's second layer row parallel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers import dense, layer_norm

_init = nnx.initializers.normal(0.02)


class Attention(nnx.Module):
    def __init__(self, d_model: int, heads: int, dropout: float, rngs: nnx.Rngs, dtype=None):
        head_dim = d_model // heads
        self.qkv = nnx.LinearGeneral(d_model, (3, heads, head_dim), use_bias=False, rngs=rngs, dtype=dtype,
                                     kernel_init=nnx.with_partitioning(_init, ("embed", None, "heads", "kv")))
        self.out = nnx.LinearGeneral((heads, head_dim), d_model, axis=(-2, -1), use_bias=False, rngs=rngs, dtype=dtype,
                                     kernel_init=nnx.with_partitioning(_init, ("heads", "kv", "embed")))
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        qkv = self.qkv(x_BxLxD)
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        length = x_BxLxD.shape[1]
        scores_BxHxLxL = jnp.einsum("bqhk,bshk->bhqs", q_BxLxHxK, k_BxLxHxK) / jnp.sqrt(q_BxLxHxK.shape[-1])
        causal = jnp.tril(jnp.ones((length, length), bool))
        scores_BxHxLxL = jnp.where(causal, scores_BxHxLxL.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores_BxHxLxL, axis=-1).astype(v_BxLxHxK.dtype)
        return self.dropout(self.out(jnp.einsum("bhqs,bshk->bqhk", probs, v_BxLxHxK)))


class Block(nnx.Module):
    def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float, rngs: nnx.Rngs, dtype=None):
        self.norm1 = layer_norm(d_model, "embed", rngs, dtype)
        self.attn = Attention(d_model, heads, dropout, rngs, dtype)
        self.norm2 = layer_norm(d_model, "embed", rngs, dtype)
        self.up = dense(d_model, d_ff, ("embed", "mlp"), rngs, dtype=dtype)
        self.down = dense(d_ff, d_model, ("mlp", "embed"), rngs, dtype=dtype)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x_BxLxD = x_BxLxD + self.attn(self.norm1(x_BxLxD))
        return x_BxLxD + self.dropout(self.down(jax.nn.gelu(self.up(self.norm2(x_BxLxD)))))


class Transformer(nnx.Module):
    def __init__(self, vocab: int = 256, seq_len: int = 128, layers: int = 2, d_model: int = 128, heads: int = 4,
                 d_ff: int = 512, dropout: float = 0.1, dtype=None, *, rngs: nnx.Rngs):
        if d_model % heads:
            raise ValueError(f"d_model {d_model} must divide by heads {heads}")
        self.seq_len = seq_len  # the longest input (the batch check reads it)
        self.token_embed = nnx.Embed(vocab, d_model, rngs=rngs, dtype=dtype,
                                     embedding_init=nnx.with_partitioning(_init, ("vocab", "embed")))
        self.pos_embed = nnx.Embed(seq_len, d_model, rngs=rngs, dtype=dtype,
                                   embedding_init=nnx.with_partitioning(_init, (None, "embed")))
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, heads, d_ff, dropout, rngs, dtype) for _ in range(layers)])
        self.norm = layer_norm(d_model, "embed", rngs, dtype)
        self.head = dense(d_model, vocab, ("embed", "vocab"), rngs, use_bias=False, dtype=dtype)

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        positions = jnp.arange(tokens_BxL.shape[1])
        x_BxLxD = self.dropout(self.token_embed(tokens_BxL) + self.pos_embed(positions)[None])
        for block in self.blocks:
            x_BxLxD = block(x_BxLxD)
        return self.head(self.norm(x_BxLxD))  # logits_BxLxV
