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
from jaxpar.errors import ConfigError, DataError, TrainingDiverged
from jaxpar.mesh import make_mesh, parse_mesh_spec
from jaxpar.metrics import RunLogger
from jaxpar.schedules import batch_size_fn, lr_schedule, parse_batch_ramp
from jaxpar.strategies import from_config as strategy_from_config
from jaxpar.trainer import Trainer


def batch_sizes(config: Config, data_size: int) -> list[int]:
    """Every global batch size the run will use, checked against the data axis and --grad-accum."""
    if config.batch_ramp:
        sizes = [size for _, size in parse_batch_ramp(config.batch_ramp, data_size)]
        flag = "--batch-ramp"
    else:
        sizes, flag = [config.batch_size], "--batch-size"
    for size in sizes:
        if size % data_size:
            good = max(data_size, size // data_size * data_size)
            raise ConfigError(f"{flag} {size} does not divide by the data-axis size {data_size} (--mesh "
                              f"{config.mesh}); use a multiple of {data_size}, e.g. {flag} {good}")
        if (size // data_size) % config.grad_accum:
            raise ConfigError(f"--grad-accum {config.grad_accum} does not divide the per-replica batch "
                              f"{size // data_size} ({flag} {size} / data axis {data_size})")
    return sizes


def make_optimizer(config: Config, schedule) -> optax.GradientTransformation:
    if config.optimizer == "adamw":
        return optax.adamw(schedule, weight_decay=config.weight_decay)
    momentum = 0.9 if config.optimizer == "momentum" else None
    return optax.chain(optax.add_decayed_weights(config.weight_decay), optax.sgd(schedule, momentum=momentum))


def datasets(config: Config, size_at, largest: int):
    """(train batches, held-out source or None) for the config's model."""
    if config.model == "transformer":
        train_tokens, val_tokens = data.split_text(data.load_text(config.data))
        train = data.text_batches(train_tokens, size_at, config.seq_len, config.seed, "training text",
                                  largest_batch=largest)
        held_out = data.TextWindows(val_tokens, config.seq_len)
    else:
        if config.data is not None:
            raise ConfigError(f"--data {config.data!r}: the {config.model} model trains on the built-in digits "
                              f"dataset; --data applies to --model transformer")
        train_split, test_split = data.load_digits()
        train = data.array_batches(train_split, size_at, config.seed, "digits training split", largest_batch=largest)
        held_out = data.ArraySource(test_split)
    return train, held_out


def train(config: Config) -> dict:
    """Trains `config.model` and returns a summary (final training metrics, held-out metrics, throughput)."""
    config.validate()
    data_axis = parse_mesh_spec(config.mesh)[0]
    if data_axis != -1:
        batch_sizes(config, data_axis)
    ramp = parse_batch_ramp(config.batch_ramp) if config.batch_ramp else None
    size_at = batch_size_fn(config.batch_size, ramp)
    largest = max(batch_sizes(config, 1))
    train_batches, held_out = datasets(config, size_at, largest)
    mesh = make_mesh(config.mesh)
    data_size = mesh.shape["data"]
    batch_sizes(config, data_size)
    if config.eval_batches and len(held_out) < data_size:
        raise DataError(f"the held-out split has {len(held_out)} examples, fewer than the {data_size} data replicas; "
                        f"use more data (--data) or --eval-batches 0")

    schedule = lr_schedule(config.lr, config.steps, scaling=config.lr_scaling, base_batch_size=config.base_batch_size,
                           batch_at=size_at, warmup_steps=config.warmup_steps, schedule=config.lr_schedule,
                           decay_steps=config.decay_steps(), decay_factor=config.lr_decay_factor)
    explicit = config.strategy != "sync" or config.allreduce is not None  # shard_map: each replica sees its slice
    local_bn = config.bn == "local" or explicit
    bn_groups = data_size if local_bn and not explicit else 1  # under shard_map the slice is already local
    trainer = Trainer(model=models.factory(config, bn_groups=bn_groups),
                      loss_fn=models.loss_for(config), eval_loss_fn=models.LOSSES[config.model],
                      optimizer=make_optimizer(config, schedule), mesh=mesh,
                      rules=config.rules, strategy=strategy_from_config(config), grad_accum=config.grad_accum)
    state = trainer.init(config.seed)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    print(f"jaxpar: {config.model} ({n_params:,} parameters, {config.dtype}) on mesh data={data_size} x "
          f"model={mesh.shape['model']} ({mesh.size} {mesh.devices.flat[0].platform} devices); global batch "
          f"{config.batch_ramp or config.batch_size} ({size_at(0) // data_size} per replica at first); strategy "
          f"{config.strategy}; BatchNorm {'local' if local_bn else 'sync'} if any; {config.steps} steps", flush=True)

    host_lrs = np.asarray(schedule(np.arange(config.steps)))  # for logging, computed once
    logger = RunLogger(config.steps, size_at, config.log_every, config.metrics)
    last = {}

    def on_step(step, metrics):
        if not math.isfinite(metrics["loss"]):
            raise TrainingDiverged(f"training diverged: loss is {metrics['loss']} at step {step}; lower --lr, add "
                                   f"--warmup-steps or use a smaller --batch-size")
        metrics = {**metrics, "lr": float(host_lrs[step - 1]), "batch_size": float(size_at(step - 1))}
        last.update(metrics)
        logger.on_step(step, metrics)

    batches = data.prefetch_to_device(train_batches, trainer.shard_batch)
    try:
        started, done, held = time.perf_counter(), 0, {}
        while done < config.steps:
            chunk = min(config.eval_every or config.steps, config.steps - done)
            state = trainer.fit(state, batches, chunk, on_step)
            done += chunk
            if config.eval_batches and (config.eval_every or done == config.steps):
                held = evaluate(trainer, state, held_out, largest, config)
                logger.write({"step": done, **{"eval_" + k: v for k, v in held.items()}})
                print(f"held-out at step {done}: " + "  ".join(f"{k} {v:.4g}" for k, v in held.items()), flush=True)
        seconds = time.perf_counter() - started
    finally:
        logger.close()
    summary = {"final_" + k: v for k, v in last.items()}
    summary.update(steps=config.steps, seconds=seconds, steps_per_sec=config.steps / seconds)
    summary.update({"eval_" + k: v for k, v in held.items()})
    return summary


def evaluate(trainer: Trainer, state, source, batch_size: int, config: Config) -> dict[str, float]:
    """Mean eval-mode metrics on the held-out split, in a fixed order.

    Digits (an array source): the whole test split in one batch, cut to a multiple of the data-axis size (300 ->
    296 on 8 replicas). Text: the first `config.eval_batches` training-sized batches of validation windows (fewer
    if the split is smaller).
    """
    data_size = trainer.data_size
    if isinstance(source, data.ArraySource) or len(source) < batch_size:
        batch_size, count = len(source) // data_size * data_size, 1
    else:
        count = min(config.eval_batches, len(source) // batch_size)
    batches = data.Batches(source, batch_size, seed=0, name="held-out split", shuffle=False)
    totals: dict[str, float] = {}
    for _ in range(count):
        for k, v in jax.device_get(trainer.evaluate(state, next(batches))).items():
            totals[k] = totals.get(k, 0.0) + float(v) / count
    if config.model == "transformer" and "loss" in totals:
        totals["perplexity"] = math.exp(totals["loss"])
    return totals
