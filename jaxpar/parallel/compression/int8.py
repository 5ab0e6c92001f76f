"""int8: error feedback (v = gradient + residual), per-chunk (`INT8_CHUNK` elements of one leaf) scale absmax/127,
codes round(v/scale); the codes and scales are ALL-GATHERED and every replica decodes and sums them in float32 in
the same order (the exact mean of the quantized values, identical on every replica, no second quantization).

Summing int32 codes instead (psum with a shared scale) puts 4 bytes per element on the wire, as many as float32. The
all-gather sends (N-1) x (n + 4 n / chunk) bytes per device against float32's ring 2(N-1)/N x 4n: N/8 of it (1/4 on
2 replicas, even at 8); see docs/compression.md. The chunks of a leaf are its own (each leaf zero-padded to whole
chunks). `int8:noef` drops the quantisation error every step instead (no residual).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxpar.parallel.compression.error_feedback import NO_EF, f32, finite_or_zero, residuals, with_residual

INT8_CHUNK = 256  # elements per int8 scale: the scales add 4/256 = 1.6% to the codes' bytes


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


class Int8:
    """int8 codes with per-chunk scales, error feedback (unless `error_feedback=False`: the quantisation error is
    dropped every step), all-gathered and summed in float32."""

    elementwise = True

    def __init__(self, error_feedback: bool = True):
        self.error_feedback = error_feedback
        self.name = "int8" if error_feedback else f"int8:{NO_EF}"

    def init(self, params):
        return residuals(params, self.error_feedback), ()

    def mean(self, leaves, own, shared, exchange, n, axis_name):
        if not leaves:
            return leaves, own, shared
        v = with_residual(leaves, own)
        # chunks never straddle two leaves: a leaf replicated over a within-replica axis then gets the same codes
        # on each of its devices, whatever the sharded leaves next to it hold
        encoded = [int8_encode(x.ravel()) for x in v]
        codes = jnp.concatenate([c for c, _ in encoded])
        scales = jnp.concatenate([s for _, s in encoded])
        all_codes, all_scales = exchange.gather((codes, scales))
        mean = jnp.sum(f32(all_codes) * all_scales[..., None], axis=0) / n  # [K, C]
        out, residual, offset = [], [], 0
        for g, x, (c, s) in zip(leaves, v, encoded):
            k = c.shape[0]
            out.append(mean[offset:offset + k].reshape(-1)[:x.size].reshape(x.shape).astype(g.dtype))
            residual.append(finite_or_zero(x - int8_decode(c, s, x.size).reshape(x.shape)))
            offset += k
        return out, residual if self.error_feedback else own, shared

    def flops(self, shapes, n) -> dict:
        """Per element: + residual, |x|, max, divide, round, clip (2), cast, own decode and the new residual (10),
        then decoding and summing all N replicas' codes (3 N)."""
        size = sum(-(-math.prod(s) // INT8_CHUNK) * INT8_CHUNK for s in shapes)
        return {"elementwise": (10 + 3 * n) * size}

    def payload(self, shapes, n) -> dict:
        chunks = sum(-(-math.prod(s) // INT8_CHUNK) for s in shapes)
        return {"all-gather": chunks * INT8_CHUNK + 4 * chunks} if chunks else {}
