"""The one list of built-in models: each model's constructor, loss, config defaults, dataset and batch layout.

Every reader asks this table: the CLI's `--model` choices and the fields that apply to each model (with their
defaults), the flags that set each logical dimension, `models.factory`, `models.loss_for` and `models.LOSSES`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

from models.batches import BatchKey, check_batch, checked
from models.cnn import CNN
from models.losses import classification_loss, lm_loss
from models.mlp import MLP
from models.transformer import BLOCKS, Transformer

DIGITS = "digits"  # scikit-learn's 8x8 digits, 10 classes
TEXT = "text"  # bytes of a text file or folder


@dataclass(frozen=True)
class ModelSpec:
    """One built-in model."""

    summary: str  # for --help
    build: Callable[..., Callable]  # (config, dtype, bn_groups) -> (rngs -> nnx.Module)
    loss: Callable  # (model, batch[, rngs], label_smoothing=0.0) -> (loss, metrics), checking the batch first
    defaults: dict[str, Any]  # the config fields that apply only to this model -> their defaults (None: derived)
    dataset: str  # DIGITS | TEXT
    dimensions: dict[str, str] = field(default_factory=dict)  # logical axis name -> the config field that sets it
    blocks: str | None = None  # the config field counting its repeated blocks (for --explain), if any


def _transformer(config, dtype, bn_groups):
    block = getattr(config, "block", None) or BLOCKS[0]
    return lambda rngs: Transformer(vocab=config.vocab, seq_len=config.seq_len, layers=config.layers,
                                    d_model=config.d_model, heads=config.heads, d_ff=config.d_ff,
                                    dropout=config.dropout, dtype=dtype, block=block, rngs=rngs)


def _mlp(config, dtype, bn_groups):
    return lambda rngs: MLP(hidden=config.hidden, dropout=config.dropout, dtype=dtype, rngs=rngs)


def _cnn(config, dtype, bn_groups):
    return lambda rngs: CNN(channels=tuple(config.channels), dropout=config.dropout, bn_groups=bn_groups,
                            dtype=dtype, rngs=rngs)


def _image_shape(model) -> str:
    return f"[B, {model.in_features}] or [B, H, W, C] with H x W x C = {model.in_features}"


_TOKENS = BatchKey("tokens", "integer", lambda shape, model: len(shape) == 2 and 2 <= shape[1] <= model.seq_len + 1,
                   lambda model: f"[B, L + 1] with 1 <= L <= seq_len {model.seq_len}")
_LABEL = BatchKey("label", "integer", lambda shape, model: len(shape) == 1, lambda model: "[B]")
_FLAT_IMAGE = BatchKey("image", "floating", lambda shape, model: len(shape) >= 2 and _size(shape[1:]) ==
                       model.in_features, _image_shape)
_IMAGE = BatchKey("image", "floating", lambda shape, model: len(shape) == 4 and shape[-1] == model.in_channels,
                  lambda model: f"[B, H, W, {model.in_channels}]")


def lm_loss_with_rngs(model, batch, rngs=None, label_smoothing: float = 0.0):
    """The transformer's loss: `lm_loss` with the model called as `model(inputs, rngs=rngs)`, its batch checked
    first. The trainer passes fresh dropout rngs every step (a loss with an `rngs` parameter, `jaxpar.train.step`):
    the transformer's Dropout modules own no RNG streams, so its stacked blocks can be pipelined."""
    check_batch("transformer", batch, model, (_TOKENS,))
    return lm_loss(functools.partial(model, rngs=rngs), batch, label_smoothing)


def _size(shape) -> int:
    return functools.reduce(lambda a, b: a * b, shape, 1)


REGISTRY: dict[str, ModelSpec] = {
    "transformer": ModelSpec(
        "byte-level LM, Llama-style blocks stacked", _transformer, lm_loss_with_rngs,
        {"layers": 2, "d_model": 128, "heads": 4, "d_ff": 512, "seq_len": 128, "vocab": 256, "block": BLOCKS[0],
         "data": None},
        TEXT, {"mlp": "d_ff", "heads": "heads", "vocab": "vocab", "embed": "d_model", "layers": "layers"},
        blocks="layers"),
    "mlp": ModelSpec("digits classifier", _mlp, checked("mlp", classification_loss, (_FLAT_IMAGE, _LABEL)),
                     {"hidden": 128}, DIGITS, {"mlp": "hidden"}),
    "cnn": ModelSpec("digits classifier with BatchNorm", _cnn, checked("cnn", classification_loss, (_IMAGE, _LABEL)),
                     {"channels": (16, 32), "bn": None}, DIGITS, {"mlp": "channels"}),
}
MODELS = tuple(REGISTRY)
LOSSES = {name: spec.loss for name, spec in REGISTRY.items()}  # name -> loss (the eval loss: no label smoothing)


def spec(name: str) -> ModelSpec:
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return REGISTRY[name]
