"""Built-in Flax NNX models: `factory(config)` gives a `rngs -> nnx.Module` constructor, `LOSSES` their losses."""

from __future__ import annotations

from models.cnn import CNN
from models.losses import classification_loss, lm_loss
from models.mlp import MLP
from models.transformer import Transformer

LOSSES = {"transformer": lm_loss, "mlp": classification_loss, "cnn": classification_loss}


def factory(config):
    """A constructor `rngs -> nnx.Module` for `config.model`, sized by the config."""
    if config.model == "transformer":
        return lambda rngs: Transformer(vocab=config.vocab, seq_len=config.seq_len, layers=config.layers,
                                        d_model=config.d_model, heads=config.heads, d_ff=config.d_ff,
                                        dropout=config.dropout, rngs=rngs)
    if config.model == "mlp":
        return lambda rngs: MLP(hidden=config.hidden, dropout=config.dropout, rngs=rngs)
    if config.model == "cnn":
        return lambda rngs: CNN(channels=tuple(config.channels), dropout=config.dropout, rngs=rngs)
    raise ValueError(f"unknown model {config.model!r}")


__all__ = ["CNN", "MLP", "Transformer", "LOSSES", "factory", "classification_loss", "lm_loss"]
