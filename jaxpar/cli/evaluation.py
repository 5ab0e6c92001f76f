"""The held-out evaluation of a run's parameters (the emulated run's, during and at the end, and the Ray runtime's
server parameters at the end): the same batches and the same metrics whatever runtime trained them."""

from __future__ import annotations

import math

import jax

import models
from jaxpar.cli.config import Config
from jaxpar.io import data
from jaxpar.train.trainer import Trainer


def evaluate(trainer: Trainer, state, source, batch_size: int, config: Config) -> dict[str, float]:
    """Mean eval-mode metrics on the held-out split, in a fixed order.

    Digits (an array source): the whole test split in one batch, cut to a multiple of the batch axes' size (300 ->
    296 on 8 devices). Text: the first `config.eval_batches` training-sized batches of validation windows (fewer
    if the split is smaller); its perplexity too.
    """
    ways = trainer.batch_divisor
    if isinstance(source, data.ArraySource) or len(source) < batch_size:
        batch_size, count = len(source) // ways * ways, 1
    else:
        count = min(config.eval_batches, len(source) // batch_size)
    batches = data.Batches(source, batch_size, seed=0, name="held-out split", shuffle=False, rows=trainer.local_rows)
    totals: dict[str, float] = {}
    for _ in range(count):
        for k, v in jax.device_get(trainer.evaluate(state, next(batches))).items():
            totals[k] = totals.get(k, 0.0) + float(v) / count
    if models.spec(config.model).dataset == models.registry.TEXT and "loss" in totals:
        totals["perplexity"] = math.exp(totals["loss"])
    return totals
