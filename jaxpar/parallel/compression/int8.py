"""int8 as a two-shot quantized all-reduce (EQuARX; 1-bit Adam's compressed all-reduce; ZeRO++):

1. error feedback (v = gradient + the sender's residual), per-chunk (`INT8_CHUNK` elements of one leaf) scale
   absmax/127, codes round(v/scale); the chunks cut into N equal shards (zero chunks pad the last), and an
   all-to-all sends shard j's codes and scales to device j (the reduce-scatter);
2. each device dequantizes the N copies of its shard it received and sums them in float32, in a fixed order;
3. it requantizes its shard's mean plus its own residual (the owner's error feedback), per chunk as in 1;
4. an all-gather of the int8 shards: every replica decodes the same codes, so the mean is identical everywhere.

Bytes per device: 2(N-1)/N x (n + 4 n / chunk), against float32's ring 2(N-1)/N x 4n: (1 + 4/256) / 4 = 0.254 at
any N. The parameter server (`ps`) pushes every device's codes to device 0, which sums them in float32, requantizes
the mean (its owner residual covers every chunk) and sends the codes back. `int8:noef` keeps neither residual.

State (`init`): {"owner": ..., "sender": ...}, each params-shaped float32 (what `jax.tree.leaves` hands `mean` in
that order). The sender's residual is the error of quantizing v; the owner's holds, at the elements of the shard
this replica owns, the error of requantizing the mean (zeros elsewhere), so summed over the replicas it is the whole
second error (`OWNER` residuals are summed, not averaged, when a checkpoint is restored onto another replica count).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpar.parallel.compression.error_feedback import NO_EF, f32, finite_or_zero, residuals, with_residual

INT8_CHUNK = 256  # elements per int8 scale: the scales add 4/256 = 1.6% to the codes' bytes
OWNER, SENDER = "owner", "sender"  # the two residuals (sorted: the order `jax.tree.leaves` gives them)


def int8_encode(flat):
    """(codes int8 [K, C], scales float32 [K]) of a float32 vector (zero-padded to K x INT8_CHUNK)."""
    chunks = jnp.pad(flat, (0, -flat.shape[0] % INT8_CHUNK)).reshape(-1, INT8_CHUNK)
    amax = jnp.max(jnp.abs(chunks), axis=1)
    # an all-zero chunk: scale 1; a non-finite amax (NaN too, which `amax > 0` would have taken for 0): a
    # non-finite scale, so the mean is too and the trainer's guard sees it
    scales = jnp.where(amax == 0, 1.0, amax / 127.0)
    codes = jnp.clip(jnp.round(chunks / scales[:, None]), -127, 127)
    return jnp.where(jnp.isfinite(codes), codes, 0).astype(jnp.int8), scales


def int8_decode(codes, scales, size: int):
    return (codes.astype(jnp.float32) * scales[..., None]).reshape(*codes.shape[:-2], -1)[..., :size]


class Layout:
    """Where the two-shot exchange puts each element (static, from the leaves' sizes): the leaves side by side,
    grouped by `groups` (leaves of one group may share a chunk: on a replica of several devices, the leaves split
    over the same within-replica axes; None: every leaf its own group), in `shards` equal shards of `length`
    elements (zeros pad the last); in each shard a chunk starts every `INT8_CHUNK` elements and where a group
    starts. `ids[s, j]`: the chunk, within shard s, of its element j; `chunks`: the most chunks of a shard."""

    def __init__(self, sizes, groups, shards: int):
        groups = list(range(len(sizes))) if groups is None else list(groups)
        first = {}
        for g in groups:
            first.setdefault(g, len(first))
        self.order = sorted(range(len(sizes)), key=lambda i: first[groups[i]])
        self.sizes, self.shards = list(sizes), shards
        self.size = sum(sizes)
        self.length = max(1, -(-self.size // shards))
        starts = np.zeros(shards * self.length, bool)
        position, previous = 0, None
        for i in self.order:
            if groups[i] != previous and position:
                starts[position] = True
            previous, position = groups[i], position + sizes[i]
        starts = starts.reshape(shards, self.length)
        starts[:, ::INT8_CHUNK] = True
        self.ids = (np.cumsum(starts, axis=1) - 1).astype(np.int32)
        self.chunks = int(self.ids.max()) + 1

    def flat(self, leaves):
        """[shards, length] float32: the leaves in this layout."""
        flat = jnp.concatenate([f32(leaves[i]).ravel() for i in self.order])
        return jnp.pad(flat, (0, self.shards * self.length - self.size)).reshape(self.shards, self.length)

    def leaves(self, flat, like):
        """The leaves shaped like `like` from `flat` ([shards, length])."""
        flat, out, offset = flat.reshape(-1), [None] * len(like), 0
        for i in self.order:
            out[i] = flat[offset:offset + self.sizes[i]].reshape(like[i].shape)
            offset += self.sizes[i]
        return out

    def payload(self) -> int:
        """Bytes of one shard: its int8 codes and a float32 scale per chunk."""
        return self.length + 4 * self.chunks


def encode_rows(x, ids, chunks: int):
    """(codes int8, scales float32 [rows, chunks]) of `x` [rows, length], chunk ids per row `ids`: scale = chunk
    absmax / 127 (an empty or all-zero chunk: 1; a non-finite one stays non-finite, so the mean is too and the
    trainer's guard sees it), codes round(x / scale)."""
    rows = x.shape[0]
    segments = (ids + chunks * jnp.arange(rows, dtype=jnp.int32)[:, None]).ravel()
    amax = jax.ops.segment_max(jnp.abs(x).ravel(), segments, num_segments=rows * chunks).reshape(rows, chunks)
    scales = jnp.where(amax <= 0, 1.0, amax / 127.0)
    codes = jnp.clip(jnp.round(x / jnp.take_along_axis(scales, ids, axis=1)), -127, 127)
    return jnp.where(jnp.isfinite(codes), codes, 0).astype(jnp.int8), scales


def decode_rows(codes, scales, ids):
    return f32(codes) * jnp.take_along_axis(scales, ids, axis=1)


class Int8:
    """int8 codes with per-chunk scales, a two-shot all-reduce (all-to-all, float32 sum, requantize, all-gather)
    with error feedback at both quantizations (unless `error_feedback=False`)."""

    elementwise = True

    def __init__(self, error_feedback: bool = True):
        self.error_feedback = error_feedback
        self.name = "int8" if error_feedback else f"int8:{NO_EF}"

    def init(self, params):
        if not self.error_feedback:
            return (), ()
        return {OWNER: residuals(params, True), SENDER: residuals(params, True)}, ()

    def mean(self, leaves, own, shared, exchange, n, axis_name):
        if not leaves:
            return leaves, own, shared
        owner, sender = (own[:len(leaves)], own[len(leaves):]) if own else ([], [])
        ps = exchange.algorithm == "ps"  # device 0 owns every chunk: the others' sums are discarded by the pull
        layout = Layout([x.size for x in leaves], exchange.groups, 1 if ps else n)
        ids = jnp.asarray(layout.ids)
        v = with_residual(leaves, sender)
        flat = layout.flat(v)  # [shards, length]
        codes, scales = encode_rows(flat, ids, layout.chunks)
        if ps:
            got_codes, got_scales = exchange.push((codes, scales))  # [N, 1, ...]
            slot = 0
        else:  # row i: device i's codes of this device's shard
            got_codes, got_scales = exchange.scatter((codes, scales))
            got_codes, got_scales = got_codes[:, None], got_scales[:, None]
            slot = lax.axis_index(axis_name)
        mine_ids = lax.dynamic_slice_in_dim(ids, slot, 1)
        total = decode_rows(got_codes[0], got_scales[0], mine_ids)
        for i in range(1, n):  # in a fixed order
            total = total + decode_rows(got_codes[i], got_scales[i], mine_ids)
        mine = total / n
        if owner:
            mine = mine + lax.dynamic_slice_in_dim(layout.flat(owner), slot, 1)
        mine_codes, mine_scales = encode_rows(mine, mine_ids, layout.chunks)
        if ps:
            all_codes, all_scales = exchange.pull((mine_codes, mine_scales))
        else:
            all_codes, all_scales = exchange.gather((mine_codes[0], mine_scales[0]))
        out = [m.astype(g.dtype) for m, g in zip(layout.leaves(decode_rows(all_codes, all_scales, ids), leaves),
                                                 leaves)]
        if not self.error_feedback:
            return out, own, shared
        new_sender = [finite_or_zero(r) for r in layout.leaves(flat - decode_rows(codes, scales, ids), leaves)]
        error = finite_or_zero(mine - decode_rows(mine_codes, mine_scales, mine_ids))
        if ps:
            error = jnp.where(lax.axis_index(axis_name) == 0, error, jnp.zeros_like(error))
        owned = lax.dynamic_update_slice_in_dim(jnp.zeros_like(flat), error, slot, 0)
        return out, (layout.leaves(owned, leaves) if owner else []) + new_sender, shared

    def flops(self, shapes, n) -> dict:
        """Per element: + residual, |x|, max, divide, round, clip (2), cast, own decode and the new residual (10);
        decoding and summing N copies of 1/N of the elements (3); the owner's residual, requantizing and its new
        residual on 1/N of them (11 / N); decoding the gathered mean (2)."""
        size = sum(math.prod(s) for s in shapes)
        return {"elementwise": int((15 + 11 / n) * size)}

    def payload(self, shapes, n) -> dict:
        """{"all-to-all": every shard's codes and scales (each device keeps 1 of its N), "all-gather": one
        shard's}, the leaves in one group (`Layout`; a replica of several devices adds a chunk where a group
        starts); `n` = 1: the parameter server's push and pull (one shard, the whole buffer)."""
        sizes = [math.prod(s) for s in shapes]
        if not sum(sizes):
            return {}
        one = Layout(sizes, [0] * len(sizes), n).payload()
        return {"all-to-all": n * one, "all-gather": one}
