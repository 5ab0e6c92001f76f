"""Small constructors that attach logical axis names to parameters (see jaxpar/sharding.py for the rules)."""

from __future__ import annotations

from flax import nnx

_zeros = nnx.initializers.zeros_init()
_ones = nnx.initializers.ones_init()


def dense(in_features, out_features, names: tuple, rngs: nnx.Rngs, use_bias: bool = True) -> nnx.Linear:
    """`nnx.Linear` whose kernel dimensions are named `names` = (input name, output name)."""
    return nnx.Linear(in_features, out_features, use_bias=use_bias, rngs=rngs,
                      kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), names),
                      bias_init=nnx.with_partitioning(_zeros, names[1:]))


def layer_norm(features: int, name: str, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(features, rngs=rngs, scale_init=nnx.with_partitioning(_ones, (name,)),
                         bias_init=nnx.with_partitioning(_zeros, (name,)))


def batch_norm(features: int, name: str, rngs: nnx.Rngs, momentum: float = 0.9) -> nnx.BatchNorm:
    return nnx.BatchNorm(features, momentum=momentum, rngs=rngs,
                         scale_init=nnx.with_partitioning(_ones, (name,)),
                         bias_init=nnx.with_partitioning(_zeros, (name,)))
