"""The gradient's reduction over fsdp written by hand: a reduce-scatter, compressed by the run's codec.

Under ZeRO-3 each device's gradient of the (all-gathered) parameters is a full-size partial sum; the sum over fsdp
must end split like the stored parameters (each device its fsdp shard). Under the default `Sync()` XLA's
partitioner inserts that reduction after `jax.grad` has already returned the reduced gradient, so no codec can
reach it (`benchmarks/fsdp_hook.py` shows it; docs/compression.md). Where jaxpar splits a replica's rows over fsdp
by hand (`jaxpar.strategies.replicas`), the unreduced gradient is a value, and this module reduces it:

- ``float32`` (PowerSGD, or a codec of the user's): XLA's reduce-scatter (`lax.psum_scatter`), (F-1)/F x 4 bytes
  per element of the full gradient per device.
- ``bf16`` / ``fp16``: each device casts its full partial gradient (fp16: x a per-leaf power of two 2^floor(log2(
  65504 / amax)), amax over fsdp, one small pmax), an all-to-all sends block j to device j as 16 bits, and each
  device sums the F blocks it received in float32: half the float32 bytes. (XLA:CPU promotes a 16-bit
  reduce-scatter to float32, so it is an all-to-all; the sum never rounds, so fp16 needs no factor F in its scale.)
- ``int8`` (ZeRO++'s qgZ): each device quantizes block j of its partial gradient per chunk of `INT8_CHUNK`
  elements (scale = chunk absmax / 127), an all-to-all sends block j's codes and scales to device j, and each device
  dequantizes the F blocks it received and sums them in float32: (1 + 4/256) / 4 of the float32 bytes, at any F.

No error feedback on this leg: its residual would be each device's unreduced, full-size gradient error, one more
full copy of the gradient per device, which undoes ZeRO-3's 1/F (ZeRO++'s qgZ keeps none either). The data leg
after it keeps its error feedback on the fsdp shard (`jaxpar.parallel.compression`). PowerSGD's leg is float32:
low rank on this leg would need the same full-size residual, and without it each step's discarded part of the
gradient is lost for good.

Parameters whole over fsdp (too small to split, or indivisible) are averaged over fsdp by the codec's own
all-reduce (`jaxpar.parallel.compression`, without error feedback; float32: one pmean).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd
from jaxpar.parallel.collectives.communicators import communicator
from jaxpar.parallel.compression.casts import FP16_MAX, Cast
from jaxpar.parallel.compression.communicator import CompressedCommunicator
from jaxpar.parallel.compression.exchange import Exchange
from jaxpar.parallel.compression.int8 import INT8_CHUNK, Int8, int8_encode

FLOAT32 = "float32"


def leg(codec) -> str:
    """The wire format of the fsdp leg for a codec (None: no codec): float32, bf16, fp16 or int8."""
    if isinstance(codec, Cast):
        return codec.name
    if isinstance(codec, Int8):
        return "int8"
    return FLOAT32


def reduce_scatter(stacked, param_shardings, mesh, codec=None):
    """The mean over fsdp of each device's unreduced gradient, each device keeping its shard.

    `stacked`: params-shaped, inside a replica-manual shard_map, each leaf [F, *shape] with entry f the gradient of
    fsdp device f (`shd.per_fsdp_device`). Returns params-shaped gradients laid out like `param_shardings`."""
    fsdp = mesh_lib.axis_name(mesh, mesh_lib.FSDP_AXIS)
    layouts = [shd.fsdp_split(s) for s in jax.tree.leaves(param_shardings, is_leaf=lambda x: hasattr(x, "spec"))]
    in_specs, out_specs = shd.fsdp_reduce_specs(param_shardings)
    wire = leg(codec)

    def body(tree):
        leaves, treedef = jax.tree.flatten(tree)
        blocks = [_own_blocks(x[0], layout, fsdp) if layout else None for x, layout in zip(leaves, layouts)]
        split = [i for i, b in enumerate(blocks) if b is not None]
        whole = [i for i, b in enumerate(blocks) if b is None]
        out = [None] * len(leaves)
        for i, mean in zip(split, _REDUCE_SCATTER[wire]([blocks[i] for i in split], fsdp)):
            out[i] = mean.astype(leaves[i].dtype)
        for i, mean in zip(whole, _whole_mean(wire, codec, [leaves[i][0] for i in whole], fsdp)):
            out[i] = mean.astype(leaves[i].dtype)
        return jax.tree.unflatten(treedef, out)

    inside = set(mesh_lib.axis_names(mesh, mesh_lib.WITHIN_REPLICA_AXES))
    # no `mesh=`: inside the replica-manual shard_map the context mesh is the one to use
    return jax.shard_map(body, in_specs=(in_specs,), out_specs=out_specs, axis_names=inside,
                         check_vma=False)(stacked)


def _whole_mean(wire, codec, leaves, fsdp):
    """The mean over fsdp of parameters whole over fsdp: the codec's all-reduce (`compression`: bf16 / fp16 as an
    all-to-all + all-gather of 16 bits, int8 two-shot), without its error feedback; float32: pmean."""
    if not leaves:
        return []
    if wire == FLOAT32:
        return lax.pmean(leaves, fsdp)
    means, _, _ = codec.mean(leaves, [], (), Exchange(fsdp, "psum", None), lax.axis_size(fsdp), fsdp)  # no residual
    return means


def _own_blocks(x, layout, fsdp):
    """[F, *block]: this device's block of the fsdp-split dimension as each fsdp device holds it (x has that
    dimension whole; the other axes splitting it select their part by this device's index on them)."""
    dim, axes = layout
    sizes = tuple(lax.axis_size(a) for a in axes)
    x = x.reshape(x.shape[:dim] + sizes + (x.shape[dim] // math.prod(sizes),) + x.shape[dim + 1:])
    for offset in reversed(range(len(axes))):  # the last first: the earlier sub-dimensions keep their positions
        if axes[offset] != fsdp:
            x = lax.dynamic_index_in_dim(x, lax.axis_index(axes[offset]), dim + offset, keepdims=False)
    return jnp.moveaxis(x, dim, 0)  # [F, ..., block of dim, ...]


def _rows(blocks, dtype=jnp.float32):
    """[F, total]: every block's rows side by side (written in place, see `collectives.buffers.one_buffer`)."""
    f = blocks[0].shape[0]
    buf, offset = jnp.zeros((f, sum(math.prod(b.shape[1:]) for b in blocks)), dtype), 0
    for b in blocks:
        buf = lax.dynamic_update_slice(buf, b.reshape(f, -1).astype(dtype), (0, offset))
        offset += math.prod(b.shape[1:])
    return buf


def _unpack(flat, blocks):
    out, offset = [], 0
    for b in blocks:
        size = math.prod(b.shape[1:])
        out.append(flat[offset:offset + size].reshape(b.shape[1:]))
        offset += size
    return out


def _float32(blocks, fsdp):
    if not blocks:
        return []
    f = lax.axis_size(fsdp)
    return _unpack(lax.psum_scatter(_rows(blocks), fsdp, scatter_dimension=0) / f, blocks)


def _cast(name):
    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[name]

    def reduce(blocks, fsdp):
        if not blocks:
            return []
        f = lax.axis_size(fsdp)
        scales = [jnp.float32(1.0)] * len(blocks)
        if name == "fp16":  # the sum is float32: only each value must fit float16 (no factor F)
            amax = lax.pmax(jnp.stack([jnp.max(jnp.abs(b.astype(jnp.float32))) for b in blocks]), fsdp)
            scale = jnp.exp2(jnp.floor(jnp.log2(FP16_MAX / amax)))
            scales = list(jnp.where(amax > 0, jnp.clip(scale, 2.0 ** -40, 2.0 ** 40), 1.0))
        wire = _rows([(b.astype(jnp.float32) * s).astype(dtype) for b, s in zip(blocks, scales)], dtype)
        bits = lax.all_to_all(lax.bitcast_convert_type(wire, jnp.uint16), fsdp, 0, 0)  # row i: from device i
        total = jnp.sum(lax.bitcast_convert_type(bits, dtype).astype(jnp.float32), axis=0)
        return [m / (s * f) for m, s in zip(_unpack(total, blocks), scales)]

    return reduce


def _int8(blocks, fsdp):
    if not blocks:
        return []
    f = lax.axis_size(fsdp)
    # per leaf, each destination's block in whole chunks (no chunk straddles two leaves or two devices' blocks)
    encoded = [jax.vmap(int8_encode)(b.reshape(f, -1).astype(jnp.float32)) for b in blocks]
    codes = jnp.concatenate([c for c, _ in encoded], axis=1)  # [F, K, C] int8
    scales = jnp.concatenate([s for _, s in encoded], axis=1)  # [F, K] float32
    codes, scales = lax.all_to_all((codes, scales), fsdp, 0, 0)  # row i: device i's codes of this device's block
    total = jnp.sum(codes.astype(jnp.float32) * scales[..., None], axis=0) / f  # [K, C], in a fixed order
    out, offset = [], 0
    for b, (c, _) in zip(blocks, encoded):
        k = c.shape[1]
        out.append(total[offset:offset + k].reshape(-1)[:math.prod(b.shape[1:])].reshape(b.shape[1:]))
        offset += k
    return out


_REDUCE_SCATTER = {FLOAT32: _float32, "bf16": _cast("bf16"), "fp16": _cast("fp16"), "int8": _int8}


def wire_bytes(codec, block_shapes, whole_shapes, f: int) -> float:
    """Bytes one device sends over fsdp per step for the gradient's reduction: `block_shapes`, the device's shard of
    each parameter split over fsdp (a reduce-scatter or all-to-all sends F-1 blocks); `whole_shapes`, the device's
    part of each parameter whole over fsdp (float32: an all-reduce, 2(F-1)/F x 4 bytes per element; a codec: its
    own all-reduce's count, `CompressedCommunicator.wire_bytes`)."""
    sizes = [math.prod(s) for s in block_shapes]
    wire = leg(codec)
    if not whole_shapes:
        total = 0.0
    elif wire == FLOAT32:
        total = 2 * (f - 1) / f * 4 * sum(math.prod(s) for s in whole_shapes)
    else:
        total = CompressedCommunicator(communicator("psum"), codec).wire_bytes(whole_shapes, f)
    if not sizes:
        return total
    if wire == FLOAT32:
        return total + (f - 1) * 4 * sum(sizes)
    if wire in ("bf16", "fp16"):
        pmax = 2 * (f - 1) / f * 4 * len(sizes) if wire == "fp16" else 0.0
        return total + (f - 1) * 2 * sum(sizes) + pmax
    chunks = sum(-(-n // INT8_CHUNK) for n in sizes)
    return total + (f - 1) * chunks * (INT8_CHUNK + 4)


def _split(param_shardings, abstract_params):
    """(each device's fsdp shards, its parts of the leaves whole over fsdp, F)."""
    blocks, whole, f = [], [], 1
    for s, x in zip(jax.tree.leaves(param_shardings, is_leaf=lambda v: hasattr(v, "spec")),
                    jax.tree.leaves(abstract_params)):
        f = mesh_lib.size(s.mesh, mesh_lib.FSDP_AXIS)
        (blocks if shd.fsdp_split(s) else whole).append(s.shard_shape(x.shape))
    return blocks, whole, f


def step_wire_bytes(codec, param_shardings, abstract_params) -> float:
    """`wire_bytes` of a trainer's parameters: each device's fsdp shards and its parts of the leaves whole over
    fsdp (their shards over the other axes)."""
    return wire_bytes(codec, *_split(param_shardings, abstract_params))


# the collective that carries the split parameters' blocks, per wire format
LEG_KIND = {FLOAT32: "reduce-scatter", "bf16": "all-to-all", "fp16": "all-to-all", "int8": "all-to-all"}


def leg_traffic(codec, param_shardings, abstract_params) -> dict:
    """The fsdp leg's payload per device per step, as theory states it (the data-leg codecs' `payload`):
    {"wire": its format, "kind": the collective of the split blocks, "bytes_sent_per_device" (`wire_bytes`),
    "float32_bytes" (the same leg uncompressed), "steps" (F-1 for the blocks' one collective; the leaves whole over
    fsdp add their all-reduce's: 2(F-1) in float32, the codec's own otherwise; fp16's pmax 2(F-1)),
    "elements": of the full-size partial gradient each device reduces, F x its blocks}."""
    blocks, whole, f = _split(param_shardings, abstract_params)
    wire = leg(codec)
    steps = (f - 1) if blocks else 0
    if blocks and wire == "fp16":
        steps += 2 * (f - 1)
    if whole:
        steps += (2 * (f - 1) if wire == FLOAT32 else
                  sum(t["steps"] for t in CompressedCommunicator(communicator("psum"), codec).traffic(whole, f)))
    return {"wire": wire, "kind": LEG_KIND[wire], "fsdp": f, "steps": steps,
            "bytes_sent_per_device": wire_bytes(codec, blocks, whole, f),
            "float32_bytes": wire_bytes(None, blocks, whole, f),
            "elements": f * sum(math.prod(s) for s in blocks), "blocks": len(blocks)}
