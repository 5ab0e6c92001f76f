"""Building a run from a config: its datasets, batch sizes, lr schedule, optimizer, strategy, pipeline, model and
trainer.

Everything here checks before anything is written: a bad input fails with one line and leaves no file behind.
"""

from __future__ import annotations

import logging
import re
from typing import Any, NamedTuple

import optax

import models
from jaxpar.cli import strategies
from jaxpar.cli.batching import batch_sizes, static_batch_sizes
from jaxpar.cli.config import Config
from jaxpar.cli.options import declared, shown
from jaxpar.cli.context import check_context, context_of
from jaxpar.cli.pipelining import check_stages, pipeline_of
from jaxpar.strategies import BN_LOCAL
from jaxpar.errors import ConfigError, DataError, JaxparError, ShardingError
from jaxpar.io import data
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.train.lr_schedules import batch_size_fn, lr_schedule, parse_batch_ramp
from jaxpar.train.trainer import Trainer


class Built(NamedTuple):
    """A run's parts, every input checked."""

    trainer: Trainer
    train_batches: Any  # jaxpar.io.data.Batches (this process's rows of each global batch)
    held_out: Any  # the held-out source
    size_at: Any  # step -> global batch size
    largest: int  # the largest global batch size
    schedule: Any  # step -> lr


def make_optimizer(config: Config, schedule) -> optax.GradientTransformation:
    if config.optimizer == "adamw":
        return optax.adamw(schedule, weight_decay=config.weight_decay)
    momentum = 0.9 if config.optimizer == "momentum" else None
    return optax.chain(optax.add_decayed_weights(config.weight_decay), optax.sgd(schedule, momentum=momentum))


def datasets(config: Config, size_at, largest: int):
    """(train batches, held-out source) for the config's model, by the dataset its registry entry names."""
    if models.spec(config.model).dataset == models.registry.TEXT:
        # the corpus stays on disk: each process reads only the windows of its rows (bytes < 256 <= --vocab)
        train_tokens, val_tokens = data.split_corpus(data.open_corpus(config.data), seq_len=config.seq_len)
        train = data.text_batches(train_tokens, size_at, config.seq_len, config.seed, "training text",
                                  largest_batch=largest, read_ahead=config.read_ahead)
        return train, data.TextWindows(val_tokens, config.seq_len)
    train_split, test_split = data.load_digits()
    for split in (train_split, test_split):
        models.check_labels(split, 10)
    train = data.array_batches(train_split, size_at, config.seed, "digits training split", largest_batch=largest,
                               read_ahead=config.read_ahead)  # built in a background thread
    return train, data.ArraySource(test_split)


_NOT_DIVISIBLE = re.compile(r"^parameter \S+ of shape \([^)]*\): dimension \d+ \(logical '(?P<name>[^']+)'[^)]*\) = "
                            r"(?P<size>\d+) is not divisible by mesh axis '(?P<axis>[^']+)' of size (?P<ways>\d+)")


def as_flag_error(error: ShardingError, config: Config) -> JaxparError:
    """A built-in model's dimension that does not divide, said in flags (`--hidden`, not the logical `mlp`)."""
    found = _NOT_DIVISIBLE.match(str(error))
    option = found and models.spec(config.model).dimensions.get(found["name"])
    if not option:
        return error
    size, axis, ways = found["size"], found["axis"], int(found["ways"])
    name = shown(config, option) + ("" if declared(config)[option].flag else " (config file)")
    fits = [d for d in range(1, ways + 1) if int(size) % d == 0 and ways % d == 0][-1]
    return ConfigError(f"{name} {size} does not divide by the {axis} axis of size {ways} (--mesh {config.mesh}); "
                       f"use a multiple of {ways} for {name}, or a {axis} axis that divides {size} (e.g. {fits})")


def build(config: Config) -> Built:
    """The run `config` (validated and resolved) asks for; raises a JaxparError before anything is written."""
    static_batch_sizes(config)  # before the data is read: the cheapest check first
    ramp = parse_batch_ramp(config.batch_ramp) if config.batch_ramp else None
    size_at = batch_size_fn(config.batch_size, ramp)
    largest = max(batch_sizes(config, 1, 1))
    train_batches, held_out = datasets(config, size_at, largest)
    strategy = strategies.from_config(config)
    mesh = mesh_lib.make_mesh(config.mesh)
    if mesh_lib.TENSOR_AXIS in mesh_lib.crossing_axes(mesh):
        logging.getLogger("jaxpar").warning(
            f"--mesh {config.mesh}: the {mesh_lib.TENSOR_AXIS} axis spans processes (each has "
            f"{len(mesh.local_devices)} devices): its per-layer collectives cross hosts; a {mesh_lib.TENSOR_AXIS} axis "
            f"of at most {len(mesh.local_devices)} stays inside one")
    check_stages(config, mesh_lib.size(mesh, mesh_lib.STAGE_AXIS))  # (a -1 in --mesh is known only now)
    check_context(config, mesh_lib.seq_ways(mesh))
    ways, replicas = mesh_lib.batch_ways(mesh), mesh_lib.replica_count(mesh)
    batch_sizes(config, ways, replicas)
    if config.eval_batches and len(held_out) < ways:
        raise DataError(f"the held-out split has {len(held_out)} examples, fewer than the {ways} devices the batch "
                        f"is split over; use more data (--data) or --eval-batches 0")
    schedule = lr_schedule(config.lr, config.steps, scaling=config.lr_scaling, base_batch_size=config.base_batch_size,
                           batch_at=size_at, warmup_steps=config.warmup_steps, schedule=config.lr_schedule,
                           decay_steps=config.decay_steps(), decay_factor=config.lr_decay_factor)
    # local BatchNorm = each replica's slice; under shard_map the replica's slice is all the step sees already
    bn_groups = replicas if config.bn == BN_LOCAL and not strategy.local_statistics else 1
    try:
        trainer = Trainer(model=models.factory(config, bn_groups=bn_groups), loss_fn=models.loss_for(config),
                          eval_loss_fn=models.LOSSES[config.model], optimizer=make_optimizer(config, schedule),
                          mesh=mesh, rules=config.rules, strategy=strategy, grad_accum=config.grad_accum,
                          skip_nonfinite=config.on_nonfinite == "skip", hardware=config.hardware,
                          pipeline=pipeline_of(config), remat=config.remat, context_parallel=context_of(config))
    except ShardingError as error:
        raise as_flag_error(error, config) from None
    train_batches.rows = trainer.local_rows  # each process loads only its rows of every global batch
    return Built(trainer, train_batches, held_out, size_at, largest, schedule)
