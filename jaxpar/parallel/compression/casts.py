"""bf16 and fp16: the gradient cast to 16 bits, summed over the replicas in 16 bits by the chosen algorithm,
decoded and divided by N in float32.

fp16 scales each leaf by a power of two, 2^floor(log2(65504 / (N * amax))) where amax is the leaf's largest
|gradient| over every replica (one small pmax): every partial sum of N scaled values stays within float16's range, in
any summation order; small gradients are scaled up, away from float16's subnormals.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jaxpar.parallel.compression.error_feedback import f32

FP16_MAX = 65504.0


class Cast:
    """bf16 / fp16 on the wire, the mean in float32. No state."""

    elementwise = True

    def __init__(self, name: str):
        self.name, self.dtype = name, {"bf16": jnp.bfloat16, "fp16": jnp.float16}[name]

    def init(self, params):
        return (), ()

    def scales(self, leaves, n, axis_name):
        """fp16: per leaf 2^floor(log2(65504 / (N amax))), amax over every replica; bf16: 1."""
        if self.name == "bf16" or not leaves:
            return [jnp.float32(1.0)] * len(leaves)
        amax = lax.pmax(jnp.stack([jnp.max(jnp.abs(f32(x))) for x in leaves]), axis_name)
        scale = jnp.exp2(jnp.floor(jnp.log2(FP16_MAX / (n * amax))))
        return list(jnp.where(amax > 0, jnp.clip(scale, 2.0 ** -40, 2.0 ** 40), 1.0))

    def mean(self, leaves, own, shared, exchange, n, axis_name):
        scales = self.scales(leaves, n, axis_name)
        wire = [(f32(x) * s).astype(self.dtype) for x, s in zip(leaves, scales)]
        summed = exchange.sum(wire)
        return [(f32(t) / (s * n)).astype(x.dtype) for t, s, x in zip(summed, scales, leaves)], own, shared

    def flops(self, shapes, n) -> dict:
        """The codec's own arithmetic per device per step (what `flops` counts: the package docstring): cast, decode
        and divide, and the sum's add; fp16 also |x|, its max and the scaling."""
        return {"elementwise": (4 if self.name == "bf16" else 7) * sum(math.prod(s) for s in shapes)}

    def payload(self, shapes, n) -> dict:
        size = sum(math.prod(s) for s in shapes)
        out = {"all-reduce": 2 * size}
        if self.name == "fp16" and shapes:
            out["scales (pmax)"] = 4 * len(shapes)
        return out
