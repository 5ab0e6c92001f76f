"""`train(config)`: the whole run behind `python run.py` — config -> data -> mesh -> trainer -> loop -> evaluation.

Everything that can be checked before JAX starts (flags, files, mesh spec, batch divisibility) is checked first, so
a bad input fails in a second with one line and nothing written.
"""

from __future__ import annotations

import math
import time

import jax
import numpy as np
import optax

import models
from jaxpar import data
from jaxpar.config import Config
from jaxpar.errors import ConfigError
from jaxpar.mesh import make_mesh, parse_mesh_spec
from jaxpar.metrics import RunLogger
from jaxpar.strategies import from_config as strategy_from_config
from jaxpar.trainer import Trainer


def _check_batch(config: Config, data_size: int) -> None:
    if config.batch_size % data_size:
        good = max(data_size, config.batch_size // data_size * data_size)
        raise ConfigError(f"--batch-size {config.batch_size} does not divide by the data-axis size {data_size} "
                          f"(--mesh {config.mesh}); use a multiple of {data_size}, e.g. --batch-size {good}")


def datasets(config: Config):
    """(train batch iterator, held-out split, held-out batch iterator factory) for the config's model."""
    if config.model == "transformer":
        train_tokens, val_tokens = data.split_text(data.load_text(config.data))
        train = data.text_batches(train_tokens, config.batch_size, config.seq_len, config.seed, "training text")
        return train, lambda: data.text_batches(val_tokens, config.batch_size, config.seq_len, seed=1)
    if config.data is not None:
        raise ConfigError(f"--data {config.data!r}: the {config.model} model trains on the built-in digits dataset; "
                          f"--data applies to --model transformer")
    train_split, test_split = data.load_digits()
    train = data.array_batches(train_split, config.batch_size, config.seed, "digits training split")
    if len(test_split["label"]) < config.batch_size:
        return train, None
    return train, lambda: data.array_batches(test_split, config.batch_size, seed=1)


def train(config: Config) -> dict:
    """Trains `config.model` and returns a summary (final training metrics, held-out metrics, throughput)."""
    config.validate()
    data_axis = parse_mesh_spec(config.mesh)[0]
    if data_axis != -1:
        _check_batch(config, data_axis)
    train_batches, eval_batches = datasets(config)
    mesh = make_mesh(config.mesh)
    _check_batch(config, mesh.shape["data"])

    trainer = Trainer(model=models.factory(config), loss_fn=models.LOSSES[config.model],
                      optimizer=optax.adamw(config.lr, weight_decay=config.weight_decay), mesh=mesh,
                      rules=config.rules, strategy=strategy_from_config(config))
    state = trainer.init(config.seed)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    devices = mesh.devices.flat[0].platform
    print(f"jaxpar: {config.model} ({n_params:,} parameters) on mesh data={mesh.shape['data']} x "
          f"model={mesh.shape['model']} ({mesh.size} {devices} devices); global batch {config.batch_size} "
          f"({config.batch_size // mesh.shape['data']} per replica); strategy {config.strategy}; {config.steps} steps",
          flush=True)

    logger = RunLogger(config.steps, config.batch_size, config.log_every, config.metrics)
    last = {}
    try:
        started = time.perf_counter()
        state = trainer.fit(state, train_batches, config.steps,
                            lambda step, metrics: (last.update(metrics), logger.on_step(step, metrics)))
        seconds = time.perf_counter() - started
        summary = {"final_" + k: v for k, v in last.items()}
        summary.update(steps=config.steps, seconds=seconds, steps_per_sec=config.steps / seconds)
        if eval_batches is not None and config.eval_batches:
            held_out = evaluate(trainer, state, eval_batches(), config.eval_batches)
            if config.model == "transformer":
                held_out["perplexity"] = math.exp(held_out["loss"])
            logger.write({"step": config.steps, **{"eval_" + k: v for k, v in held_out.items()}})
            print("held-out: " + "  ".join(f"{k} {v:.4g}" for k, v in held_out.items()), flush=True)
            summary.update({"eval_" + k: v for k, v in held_out.items()})
    finally:
        logger.close()
    return summary


def evaluate(trainer: Trainer, state, batches, count: int) -> dict[str, float]:
    """Mean of the eval-mode metrics over `count` batches."""
    totals: dict[str, float] = {}
    for _ in range(count):
        for k, v in jax.device_get(trainer.evaluate(state, next(batches))).items():
            totals[k] = totals.get(k, 0.0) + float(v) / count
    return totals
