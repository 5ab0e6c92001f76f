"""A small CNN with BatchNorm for 8x8 digits; conv channels are tensor parallel (`mlp`)."""

from __future__ import annotations

import jax
from flax import nnx

from models.layers import BatchNorm, dense

_he = nnx.initializers.he_normal()


class CNN(nnx.Module):
    def __init__(self, in_channels: int = 1, channels: tuple[int, int] = (16, 32), num_classes: int = 10,
                 dropout: float = 0.0, bn_groups: int = 1, dtype=None, *, rngs: nnx.Rngs):
        """bn_groups: 1 = synchronised BatchNorm (global-batch statistics); the data-axis size = local BatchNorm."""
        c1, c2 = channels
        self.in_channels = in_channels  # (the batch check reads it)
        # conv1 splits its output channels over `model`, conv2 its input channels (Megatron's column/row pairing).
        self.conv1 = nnx.Conv(in_channels, c1, (3, 3), rngs=rngs, dtype=dtype,
                              kernel_init=nnx.with_partitioning(_he, (None, None, None, "mlp")),
                              bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",)))
        self.bn1 = BatchNorm(c1, "mlp", rngs, groups=bn_groups, dtype=dtype)
        self.conv2 = nnx.Conv(c1, c2, (3, 3), strides=(2, 2), rngs=rngs, dtype=dtype,
                              kernel_init=nnx.with_partitioning(_he, (None, None, "mlp", None)))
        self.bn2 = BatchNorm(c2, None, rngs, groups=bn_groups, dtype=dtype)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.out = dense(c2, num_classes, (None, None), rngs, dtype=dtype)

    def __call__(self, images_BxHxWxC: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.bn1(self.conv1(images_BxHxWxC)))
        x = jax.nn.relu(self.bn2(self.conv2(x)))
        return self.out(self.dropout(x.mean(axis=(1, 2))))
