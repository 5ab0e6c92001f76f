"""A decoder-only transformer language model whose blocks are one stacked module (`jaxpar.pipeline.Stack`).

Two blocks (`block=`):
- `llama` (the default), as in Llama-style decoders: pre-norm RMSNorm (scale only), rotary position embeddings on
  q and k (no position table), causal self-attention and a SwiGLU MLP, no biases anywhere; a final RMSNorm.
- `gpt`, the block before pipelining (issue 19): pre-norm LayerNorm with bias, learned positions, a fused qkv
  projection and a GELU MLP with biases; a final LayerNorm. It is kept so that checkpoints and parameters of the
  old unstacked model convert to the stacked layout (`models.convert`) and restore.

Logical axes: `vocab` (embedding rows, output classes), `embed` (d_model), `heads`, `kv` (per-head dim), `mlp`
(d_ff), and `layers`, the leading dimension of every block parameter (the stack). With the default rules, heads,
d_ff and vocab are split over `model` (Megatron-style tensor parallelism: q/k/v and the MLP's first layers column
parallel, the attention output and the MLP's last layer row parallel), and layers over `stage` (pipeline stages).

Attention is `jaxpar.attention`: on a mesh with a seq axis the sequence is split over it (context parallelism) and
RoPE and the causal mask keep global positions (the model sees the whole sequence, `jnp.arange(L)`).

Dropout (after the embedding, after attention, after the MLP) draws from call-time rngs, `model(tokens, rngs=rngs)`:
the modules own no RNG streams, so the stack can follow microbatches through pipeline stages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.parallel.context import attention
from jaxpar.pipeline import Stack
from models.layers import dense, layer_norm, rms_norm

LLAMA, GPT = "llama", "gpt"
BLOCKS = (LLAMA, GPT)  # the first is the default
ROPE_BASE = 10_000.0  # rotary positions: the wavelengths run from 2 pi to about 2 pi x ROPE_BASE

_init = nnx.initializers.normal(0.02)


def rope(x_BxLxHxK: jax.Array, positions_L: jax.Array, base: float = ROPE_BASE) -> jax.Array:
    """Rotary position embedding (Su et al.; Llama's "rotate half" layout): channel pairs (i, i + K/2) of every head
    rotated by the angle position x base^(-2i/K). Computed in float32, returned in x's dtype."""
    half = x_BxLxHxK.shape[-1] // 2
    inverse_frequency = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles_LxK2 = positions_L.astype(jnp.float32)[:, None] * inverse_frequency[None, :]
    sin, cos = jnp.sin(angles_LxK2)[None, :, None, :], jnp.cos(angles_LxK2)[None, :, None, :]
    x = x_BxLxHxK.astype(jnp.float32)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1).astype(x_BxLxHxK.dtype)


def causal_attention(q_BxLxHxK: jax.Array, k_BxLxHxK: jax.Array, v_BxLxHxK: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(K)) v, each position attending to itself and the positions before it (softmax in f32):
    `jaxpar.attention`, so that a sequence split over the mesh's seq axis attends over every key."""
    return attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, causal=True)


def _out_projection(heads: int, head_dim: int, d_model: int, rngs: nnx.Rngs, dtype) -> nnx.LinearGeneral:
    return nnx.LinearGeneral((heads, head_dim), d_model, axis=(-2, -1), use_bias=False, rngs=rngs, dtype=dtype,
                             kernel_init=nnx.with_partitioning(_init, ("heads", "kv", "embed")))


# --- llama ----------------------------------------------------------------------------------------------------------
class LlamaAttention(nnx.Module):
    def __init__(self, d_model: int, heads: int, dropout: float, rngs: nnx.Rngs, dtype=None):
        head_dim = d_model // heads

        def projection():
            return nnx.LinearGeneral(d_model, (heads, head_dim), use_bias=False, rngs=rngs, dtype=dtype,
                                     kernel_init=nnx.with_partitioning(_init, ("embed", "heads", "kv")))

        self.q, self.k, self.v = projection(), projection(), projection()
        self.out = _out_projection(heads, head_dim, d_model, rngs, dtype)
        self.dropout = nnx.Dropout(dropout)

    def __call__(self, x_BxLxD: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        positions = jnp.arange(x_BxLxD.shape[1])
        q_BxLxHxK, k_BxLxHxK = rope(self.q(x_BxLxD), positions), rope(self.k(x_BxLxD), positions)
        return self.dropout(self.out(causal_attention(q_BxLxHxK, k_BxLxHxK, self.v(x_BxLxD))), rngs=rngs)


class LlamaBlock(nnx.Module):
    """x + attention(RMSNorm(x)), then + SwiGLU(RMSNorm(x)) = down(silu(gate(x)) * up(x)); no biases."""

    def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float, rngs: nnx.Rngs, dtype=None):
        self.attn_norm = rms_norm(d_model, "embed", rngs, dtype)
        self.attn = LlamaAttention(d_model, heads, dropout, rngs, dtype)
        self.mlp_norm = rms_norm(d_model, "embed", rngs, dtype)
        self.gate = dense(d_model, d_ff, ("embed", "mlp"), rngs, use_bias=False, dtype=dtype)
        self.up = dense(d_model, d_ff, ("embed", "mlp"), rngs, use_bias=False, dtype=dtype)
        self.down = dense(d_ff, d_model, ("mlp", "embed"), rngs, use_bias=False, dtype=dtype)
        self.dropout = nnx.Dropout(dropout)

    def __call__(self, x_BxLxD: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), rngs=rngs)
        h_BxLxD = self.mlp_norm(x_BxLxD)
        return x_BxLxD + self.dropout(self.down(jax.nn.silu(self.gate(h_BxLxD)) * self.up(h_BxLxD)), rngs=rngs)


# --- gpt (the block before issue 19, stacked) -------------------------------------------------------------------
class Attention(nnx.Module):
    def __init__(self, d_model: int, heads: int, dropout: float, rngs: nnx.Rngs, dtype=None):
        head_dim = d_model // heads
        self.qkv = nnx.LinearGeneral(d_model, (3, heads, head_dim), use_bias=False, rngs=rngs, dtype=dtype,
                                     kernel_init=nnx.with_partitioning(_init, ("embed", None, "heads", "kv")))
        self.out = _out_projection(heads, head_dim, d_model, rngs, dtype)
        self.dropout = nnx.Dropout(dropout)

    def __call__(self, x_BxLxD: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        qkv = self.qkv(x_BxLxD)
        return self.dropout(self.out(causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])), rngs=rngs)


class Block(nnx.Module):
    """x + attention(LayerNorm(x)), then + down(gelu(up(LayerNorm(x)))), with biases."""

    def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float, rngs: nnx.Rngs, dtype=None):
        self.norm1 = layer_norm(d_model, "embed", rngs, dtype)
        self.attn = Attention(d_model, heads, dropout, rngs, dtype)
        self.norm2 = layer_norm(d_model, "embed", rngs, dtype)
        self.up = dense(d_model, d_ff, ("embed", "mlp"), rngs, dtype=dtype)
        self.down = dense(d_ff, d_model, ("mlp", "embed"), rngs, dtype=dtype)
        self.dropout = nnx.Dropout(dropout)

    def __call__(self, x_BxLxD: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        x_BxLxD = x_BxLxD + self.attn(self.norm1(x_BxLxD), rngs=rngs)
        return x_BxLxD + self.dropout(self.down(jax.nn.gelu(self.up(self.norm2(x_BxLxD)))), rngs=rngs)


BLOCK_CLASSES = {LLAMA: LlamaBlock, GPT: Block}


class Transformer(nnx.Module):
    def __init__(self, vocab: int = 256, seq_len: int = 128, layers: int = 2, d_model: int = 128, heads: int = 4,
                 d_ff: int = 512, dropout: float = 0.1, dtype=None, block: str = LLAMA, *, rngs: nnx.Rngs):
        if block not in BLOCK_CLASSES:
            raise ConfigError(f"Transformer(block={block!r}): choose one of {', '.join(BLOCKS)}")
        if d_model % heads:
            raise ConfigError(f"Transformer(d_model={d_model}, heads={heads}): d_model must divide by heads")
        if block == LLAMA and (d_model // heads) % 2:
            raise ConfigError(f"Transformer(d_model={d_model}, heads={heads}): rotary positions rotate channel "
                              f"pairs, so the head width d_model / heads = {d_model // heads} must be even")
        self.seq_len = seq_len  # the longest input (the batch check reads it)
        self.block = block
        self.token_embed = nnx.Embed(vocab, d_model, rngs=rngs, dtype=dtype,
                                     embedding_init=nnx.with_partitioning(_init, ("vocab", "embed")))
        if block == GPT:
            self.pos_embed = nnx.Embed(seq_len, d_model, rngs=rngs, dtype=dtype,
                                       embedding_init=nnx.with_partitioning(_init, (None, "embed")))
        self.dropout = nnx.Dropout(dropout)
        make = BLOCK_CLASSES[block]
        self.blocks = Stack(lambda rngs: make(d_model, heads, d_ff, dropout, rngs, dtype), layers, rngs=rngs)
        self.norm = (rms_norm if block == LLAMA else layer_norm)(d_model, "embed", rngs, dtype)
        self.head = dense(d_model, vocab, ("embed", "vocab"), rngs, use_bias=False, dtype=dtype)

    def __call__(self, tokens_BxL: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        x_BxLxD = self.token_embed(tokens_BxL)
        if self.block == GPT:
            x_BxLxD = x_BxLxD + self.pos_embed(jnp.arange(tokens_BxL.shape[1]))[None]
        x_BxLxD = self.blocks(self.dropout(x_BxLxD, rngs=rngs), rngs=rngs)
        return self.head(self.norm(x_BxLxD))  # logits_BxLxV
