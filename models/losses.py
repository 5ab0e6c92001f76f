"""Loss functions `(model, batch) -> (loss, metrics)` for the built-in models and datasets."""

from __future__ import annotations

import jax.numpy as jnp
import optax


def classification_loss(model, batch):
    """batch: {"image": float [B, H, W, C], "label": int [B]}."""
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["label"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["label"]).mean()}


def lm_loss(model, batch):
    """batch: {"tokens": int [B, L+1]}; predicts tokens[:, 1:] from tokens[:, :-1]."""
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    logits = model(inputs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()
    return loss, {"accuracy": (logits.argmax(-1) == targets).mean()}
