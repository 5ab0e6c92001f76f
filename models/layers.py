"""Small constructors that attach logical axis names to parameters (see jaxpar/sharding.py for the rules)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

_zeros = nnx.initializers.zeros_init()
_ones = nnx.initializers.ones_init()


def dense(in_features, out_features, names: tuple, rngs: nnx.Rngs, use_bias: bool = True, dtype=None) -> nnx.Linear:
    """`nnx.Linear` whose kernel dimensions are named `names` = (input name, output name); computes in `dtype`
    (e.g. bfloat16) while its parameters stay float32."""
    return nnx.Linear(in_features, out_features, use_bias=use_bias, rngs=rngs, dtype=dtype,
                      kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), names),
                      bias_init=nnx.with_partitioning(_zeros, names[1:]))


def layer_norm(features: int, name: str, rngs: nnx.Rngs, dtype=None) -> nnx.LayerNorm:
    return nnx.LayerNorm(features, rngs=rngs, dtype=dtype, scale_init=nnx.with_partitioning(_ones, (name,)),
                         bias_init=nnx.with_partitioning(_zeros, (name,)))


def rms_norm(features: int, name: str, rngs: nnx.Rngs, dtype=None, epsilon: float = 1e-6) -> nnx.RMSNorm:
    """RMSNorm, scale only: x / sqrt(mean(x^2 over the last axis) + epsilon) * scale, its scale named `name`."""
    return nnx.RMSNorm(features, epsilon=epsilon, rngs=rngs, dtype=dtype,
                       scale_init=nnx.with_partitioning(_ones, (name,)))


class BatchNorm(nnx.Module):
    """BatchNorm over the leading (example) axis, with the batch split into `groups` for its statistics.

    groups=1 is synchronised BatchNorm: statistics of the whole global batch (under jaxpar's sharded step, of every
    data shard together). groups = data-axis size is local BatchNorm: the global batch is sharded over `data` in
    contiguous slices, so group g is exactly replica g's slice, and each replica normalises with its own statistics,
    as unsynchronised multi-GPU BatchNorm does. Running averages are updated with the mean of the group statistics,
    so they stay identical on every replica in both modes. Numerically identical to `nnx.BatchNorm` at groups=1.
    """

    def __init__(self, features: int, name: str | None, rngs: nnx.Rngs, momentum: float = 0.9, epsilon: float = 1e-5,
                 groups: int = 1, dtype=None):
        self.scale = nnx.Param(nnx.with_partitioning(_ones, (name,))(rngs.params(), (features,)))
        self.bias = nnx.Param(nnx.with_partitioning(_zeros, (name,))(rngs.params(), (features,)))
        self.mean = nnx.BatchStat(jnp.zeros((features,), jnp.float32))
        self.var = nnx.BatchStat(jnp.ones((features,), jnp.float32))
        self.momentum, self.epsilon, self.groups, self.dtype = momentum, epsilon, groups, dtype
        self.use_running_average = False  # set by model.train() / model.eval()

    def __call__(self, x):
        if self.use_running_average:
            mean, var = self.mean[...], self.var[...]
        else:
            grouped = x.astype(jnp.float32).reshape((self.groups, x.shape[0] // self.groups) + x.shape[1:])
            axes = tuple(range(1, grouped.ndim - 1))
            group_mean = grouped.mean(axes, keepdims=True)
            group_var = jnp.maximum((grouped * grouped).mean(axes, keepdims=True) - group_mean * group_mean, 0.0)
            normalised = (grouped - group_mean) / jnp.sqrt(group_var + self.epsilon)
            stats_shape = (self.groups, -1)
            self.mean[...] = self.momentum * self.mean[...] + (1 - self.momentum) * group_mean.reshape(stats_shape).mean(0)
            self.var[...] = self.momentum * self.var[...] + (1 - self.momentum) * group_var.reshape(stats_shape).mean(0)
            y = normalised.reshape(x.shape) * self.scale[...] + self.bias[...]
            return y.astype(self.dtype or x.dtype)
        y = (x - mean) / jnp.sqrt(var + self.epsilon) * self.scale[...] + self.bias[...]
        return y.astype(self.dtype or x.dtype)
