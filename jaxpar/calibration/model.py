"""A built-in model's step calibrated on this machine (`python -m jaxpar.calibrate --model NAME`): its sync Trainer
on every device, timed at several global batches (`model_step`) on synthetic batches of the model's shapes.

A synthetic batch of n rows holds n rows drawn at random (seed 0) from one real batch of the model's dataset: the
model's shapes and dtypes, and values it accepts (labels in range, byte tokens), at any size, so a reference batch
of 16x the run's needs no dataset that large.
"""

from __future__ import annotations

import jax
import numpy as np

import models
from jaxpar.calibration import model_step
from jaxpar.cli.build import datasets, make_optimizer
from jaxpar.cli.config import Config
from jaxpar.cost.profile import Profile
from jaxpar.parallel.mesh import make_mesh
from jaxpar.train.trainer import Trainer


def synthetic_batches(example: dict, seed: int = 0):
    """`batch_of(rows)`: a batch of `rows` rows drawn at random from the rows of `example` (a batch of arrays)."""
    have = len(next(iter(example.values())))

    def batch_of(rows: int) -> dict:
        picked = np.random.default_rng(seed).integers(0, have, rows)
        return {key: np.asarray(value)[picked] for key, value in example.items()}

    return batch_of


def calibrate_model(profile: dict, model: str, batch_size: int | None = None, timer=None, progress=None,
                    rounds: int | None = None) -> dict:
    """`profile` (a calibration dict) with the built-in `model`'s step measured on every device over synthetic
    batches (`model_step`); `batch_size`: the reference's global batch (default: the model's)."""
    fields = {"batch_size": batch_size} if batch_size else {}
    config = Config(model=model, dropout=0.0, **fields).resolved()
    mesh_spec = str(len(jax.devices()))
    mesh = make_mesh(mesh_spec)
    rows = mesh.size  # one row per device: a real batch every dataset holds
    example = next(iter(datasets(config.replace(batch_size=rows), lambda step: rows, rows)[0]))

    def make_trainer():
        return Trainer(models.factory(config), models.loss_for(config), make_optimizer(config, config.lr), mesh)

    result = model_step.measure(make_trainer, synthetic_batches(example), config.batch_size, Profile.from_dict(profile),
                                timer=timer, progress=progress, rounds=rounds or model_step.ROUNDS)
    return model_step.apply(profile, model, mesh_spec, result)
