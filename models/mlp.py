"""A two-layer MLP classifier (digits: 8x8 images, 10 classes); its hidden dimension is tensor parallel (`mlp`)."""

from __future__ import annotations

import jax
from flax import nnx

from models.layers import dense


class MLP(nnx.Module):
    def __init__(self, in_features: int = 64, hidden: int = 128, num_classes: int = 10, dropout: float = 0.0,
                 dtype=None, *, rngs: nnx.Rngs):
        self.hidden = dense(in_features, hidden, ("embed", "mlp"), rngs, dtype=dtype)  # column parallel
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.out = dense(hidden, num_classes, ("mlp", None), rngs, dtype=dtype)  # row parallel
        self.in_features = in_features

    def __call__(self, images_BxHxWxC: jax.Array) -> jax.Array:
        x = images_BxHxWxC.reshape(images_BxHxWxC.shape[0], -1)
        return self.out(self.dropout(jax.nn.relu(self.hidden(x))))
