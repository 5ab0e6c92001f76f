"""Loss functions `(model, batch) -> (loss, metrics)` for the built-in models and datasets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def cross_entropy(logits, labels, label_smoothing: float = 0.0):
    """Mean softmax cross-entropy in float32; with label smoothing eps the target is (1 - eps) one-hot + eps/K."""
    logits = logits.astype(jnp.float32)
    if not label_smoothing:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
    return optax.softmax_cross_entropy(logits, targets).mean()


def classification_loss(model, batch, label_smoothing: float = 0.0):
    """batch: {"image": float [B, H, W, C], "label": int [B]}."""
    logits = model(batch["image"])
    loss = cross_entropy(logits, batch["label"], label_smoothing)
    return loss, {"accuracy": (logits.argmax(-1) == batch["label"]).mean()}


def lm_loss(model, batch, label_smoothing: float = 0.0):
    """batch: {"tokens": int [B, L+1]}; predicts tokens[:, 1:] from tokens[:, :-1]."""
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    logits = model(inputs)
    loss = cross_entropy(logits, targets, label_smoothing)
    return loss, {"accuracy": (logits.argmax(-1) == targets).mean()}
