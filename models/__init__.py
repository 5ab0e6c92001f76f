"""Built-in Flax NNX models: `factory(config, ...)` gives a `rngs -> nnx.Module` constructor, `loss_for(config)` its
loss; `REGISTRY` (models/registry.py) is the one list of them."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from models.batches import check_batch
from models.cnn import CNN
from models.losses import check_labels, classification_loss, lm_loss
from models.mlp import MLP
from models.registry import LOSSES, MODELS, REGISTRY, ModelSpec, spec
from models.transformer import Transformer


def factory(config, bn_groups: int = 1):
    """A constructor `rngs -> nnx.Module` for `config.model`, sized by the config.

    bn_groups: how many groups BatchNorm splits the global batch into for its statistics (1 = synchronised).
    Sizes the config leaves unset (None) take the model's declared defaults (`jaxpar.cli.Config.resolved`).
    """
    config = _resolved(config)
    dtype = jnp.bfloat16 if getattr(config, "dtype", "float32") == "bfloat16" else None
    return spec(config.model).build(config, dtype, bn_groups)


def _resolved(config):
    return config.resolved() if hasattr(config, "resolved") else config  # also any object with the fields


def loss_for(config):
    """`config.model`'s loss (which checks each batch shape's keys and dtypes) with the config's label smoothing."""
    config = _resolved(config)
    return functools.partial(spec(config.model).loss, label_smoothing=getattr(config, "label_smoothing", 0.0))


__all__ = ["CNN", "MLP", "Transformer", "LOSSES", "MODELS", "REGISTRY", "ModelSpec", "check_batch", "check_labels",
           "factory", "loss_for", "spec", "classification_loss", "lm_loss"]
