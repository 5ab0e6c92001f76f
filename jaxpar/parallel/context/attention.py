"""`jaxpar.attention(q, k, v, causal=True)`: softmax attention that is right on a sequence split over the seq axis.

    import jaxpar
    out_BxLxHxK = jaxpar.attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, causal=True)

A model writes attention against the whole sequence, as on one device (q, k, v: [batch, length, heads, head_dim],
positions 0..L-1 in order, e.g. RoPE from `jnp.arange(L)`). Inside a Trainer's step on a mesh with seq > 1 the
helper splits the sequence into one contiguous block per seq device and runs the trainer's algorithm
(`Trainer(context_parallel=...)`, `--context-parallel`: allgather, ring or ulysses) in a map manual over the seq
axis; the causal mask is taken from global positions. Anywhere else (one device, seq = 1, outside a trainer) it is
plain attention. A model on a seq mesh must call it: a step traced without a call is a `ModelError`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxpar.errors import ModelError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd
from jaxpar.parallel.context import blocks, settings as cp
from jaxpar.parallel.context.gather import allgather_attention, ulysses_attention
from jaxpar.parallel.context.ring import ring_attention


def attention(q, k, v, causal: bool = True, *, scale: float | None = None):
    """softmax(q k^T x scale) v over the whole sequence ([B, L, H, K] each; scale default 1 / sqrt(K)), causal by
    global position when `causal`; softmax in float32, output in v's dtype."""
    if not (q.ndim == k.ndim == v.ndim == 4 and q.shape == k.shape and k.shape == v.shape):
        raise ModelError(f"jaxpar.attention: q, k and v must be [batch, length, heads, head_dim] of one shape; got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    trace = cp.current()
    if trace is not None:
        trace.calls += 1
        trace.shapes.append((tuple(q.shape), q.dtype))
    if trace is None or trace.settings.ways == 1:
        positions = jnp.arange(q.shape[1])
        return blocks.attend(q, k, v, positions, positions, causal, scale)
    run = trace.settings
    cp.check_length(q.shape[1], run.ways, run.balanced, "the sequence reaching jaxpar.attention")
    cp.check_heads(q.shape[2], run.ways, run.algorithm)
    axis = mesh_lib.axis_name(run.mesh, mesh_lib.SEQ_AXIS)
    if run.algorithm == cp.RING:
        body = functools.partial(ring_attention, balanced=run.balanced)
    else:
        body = allgather_attention if run.algorithm == cp.ALLGATHER else ulysses_attention
    body = functools.partial(body, axis=axis, ways=run.ways, causal=causal, scale=scale)
    spec = shd.sequence_blocks(run.mesh)
    inside = jax.sharding.get_abstract_mesh()  # inside another map (a replica's, a stage's): its mesh, partly manual
    mesh = run.mesh if inside.empty or not inside.manual_axes else inside
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, axis_names={axis},
                         check_vma=False)(q, k, v)
