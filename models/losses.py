"""Loss functions `(model, batch) -> (loss, metrics)` for the built-in models and datasets.

Integer labels outside [0, classes) are not caught inside a jitted step: the cross-entropy of an out-of-range
label is silently wrong (its one-hot row is all zeros), and checking inside `jit` would need a device-to-host
sync every step. Check them on the host with `check_labels(batch, num_classes)` (the batches of a dataset once, or
every batch when they come from an untrusted source); for your own model, call it with your class count
(logits.shape[-1]) and your batch, naming the keys that hold labels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.errors import DataError

LABEL_KEYS = ("label", "tokens")  # the keys of the built-in batches that hold class indices


def check_labels(batch, num_classes: int, keys=LABEL_KEYS) -> None:
    """Raises `jaxpar.DataError` unless every `batch[key]` (for the `keys` present) holds integers in
    [0, num_classes). Host-side: reads the arrays (a jax array is copied to the host)."""
    for key in keys:
        if key not in batch:
            continue
        labels = np.asarray(batch[key])
        if not np.issubdtype(labels.dtype, np.integer):
            raise DataError(f"batch[{key!r}]: labels of dtype {labels.dtype}; they must be integers in "
                             f"[0, {num_classes})")
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise DataError(f"batch[{key!r}]: labels range over [{labels.min()}, {labels.max()}] but the model has "
                             f"{num_classes} classes; labels must be integers in [0, {num_classes})")


def cross_entropy(logits, labels, label_smoothing: float = 0.0):
    """Mean softmax cross-entropy in float32; with label smoothing eps the target is (1 - eps) one-hot + eps/K."""
    logits = logits.astype(jnp.float32)
    if not label_smoothing:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
    return optax.softmax_cross_entropy(logits, targets).mean()


def classification_loss(model, batch, label_smoothing: float = 0.0):
    """batch: {"image": float [B, H, W, C], "label": int [B]} with labels in [0, classes) (see `check_labels`)."""
    logits = model(batch["image"])
    loss = cross_entropy(logits, batch["label"], label_smoothing)
    return loss, {"accuracy": (logits.argmax(-1) == batch["label"]).mean()}


def lm_loss(model, batch, label_smoothing: float = 0.0):
    """batch: {"tokens": int [B, L+1]} with tokens in [0, vocab) (see `check_labels`); predicts tokens[:, 1:] from
    tokens[:, :-1]."""
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    logits = model(inputs)
    loss = cross_entropy(logits, targets, label_smoothing)
    return loss, {"accuracy": (logits.argmax(-1) == targets).mean()}
