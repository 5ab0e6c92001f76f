"""Built-in Flax NNX models: `factory(config, ...)` gives a `rngs -> nnx.Module` constructor, `loss_for(config)` its
loss."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from models.cnn import CNN
from models.losses import check_labels, classification_loss, lm_loss
from models.mlp import MLP
from models.transformer import Transformer

LOSSES = {"transformer": lm_loss, "mlp": classification_loss, "cnn": classification_loss}


def factory(config, bn_groups: int = 1):
    """A constructor `rngs -> nnx.Module` for `config.model`, sized by the config.

    bn_groups: how many groups BatchNorm splits the global batch into for its statistics (1 = synchronised).
    Sizes the config leaves unset (None) take the model's declared defaults (`jaxpar.Config.resolved`).
    """
    config = _resolved(config)
    dtype = jnp.bfloat16 if getattr(config, "dtype", "float32") == "bfloat16" else None
    if config.model == "transformer":
        return lambda rngs: Transformer(vocab=config.vocab, seq_len=config.seq_len, layers=config.layers,
                                        d_model=config.d_model, heads=config.heads, d_ff=config.d_ff,
                                        dropout=config.dropout, dtype=dtype, rngs=rngs)
    if config.model == "mlp":
        return lambda rngs: MLP(hidden=config.hidden, dropout=config.dropout, dtype=dtype, rngs=rngs)
    if config.model == "cnn":
        return lambda rngs: CNN(channels=tuple(config.channels), dropout=config.dropout, bn_groups=bn_groups,
                                dtype=dtype, rngs=rngs)
    raise ValueError(f"unknown model {config.model!r}")


def _resolved(config):
    return config.resolved() if hasattr(config, "resolved") else config  # also any object with the fields


def loss_for(config):
    """`config.model`'s loss with the config's label smoothing."""
    config = _resolved(config)
    return functools.partial(LOSSES[config.model], label_smoothing=getattr(config, "label_smoothing", 0.0))


__all__ = ["CNN", "MLP", "Transformer", "LOSSES", "check_labels", "factory", "loss_for", "classification_loss",
           "lm_loss"]
