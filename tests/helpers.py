"""Small models, losses and batches shared by the tests."""

import os
import re

import numpy as np
import optax

import jaxpar
import models
from jaxpar.cli import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

TINY = {
    "transformer": Config(model="transformer", layers=1, d_model=32, heads=8, d_ff=64, seq_len=8, vocab=256),
    "mlp": Config(model="mlp", hidden=32),
    "cnn": Config(model="cnn", channels=(8, 16)),
}


def batch_for(model: str, size: int = 16, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    if model == "transformer":
        return {"tokens": rng.integers(0, 256, size=(size, TINY[model].seq_len + 1)).astype(np.int32)}
    return {"image": rng.random((size, 8, 8, 1), dtype=np.float32), "label": rng.integers(0, 10, size).astype(np.int32)}


def trainer_for(model: str, mesh: str, optimizer=None, dropout: float = 0.0, **kw) -> jaxpar.Trainer:
    config = TINY[model].replace(dropout=dropout)
    return jaxpar.Trainer(model=models.factory(config), loss_fn=models.LOSSES[model],
                          optimizer=optimizer or optax.sgd(0.1), mesh=jaxpar.make_mesh(mesh), **kw)


def child_env(**extra) -> dict:
    """The environment for a process a test starts: this one's, without the CPU device count (run.py and the
    launcher create the devices they need) but with the other XLA flags (see conftest.py)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")).strip()
    env.pop("XLA_FLAGS", None)
    if flags:
        env["XLA_FLAGS"] = flags
    env.update(extra)
    return env


def clock_times(strategy, replicas: int, steps: int) -> list[float]:
    """A strategy's own simulated clock (`strategy.clock`, as a trainer reads it) after each of its first `steps`
    steps on `replicas` replicas, unit compute and free communication."""
    return [strategy.clock.time_after(replicas, step) for step in range(steps)]
