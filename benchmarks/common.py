"""What the benchmarks share: a built-in model (`models/`) with its loss and real batches, a trainer on a mesh, and
the timed step loop.

Call `jaxpar.make_mesh` before anything here touches JAX: it provides the emulated CPU devices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import jaxpar
from jaxpar.cli import Config

TEXT_BYTES = 1 << 20  # the first MiB of the default corpus: enough batches for every benchmark


@dataclass
class Setup:
    """A resolved config, its model constructor (`rngs -> nnx.Module`), its loss and one real global batch."""

    config: Config
    factory: Callable
    loss_fn: Callable
    batch: dict


def batches(config, seed: int = 0):
    """Global training batches for `config`: the default corpus for the transformer, digits for mlp / cnn."""
    from jaxpar.io import data

    if config.model == "transformer":
        return data.text_batches(data.load_text(max_bytes=TEXT_BYTES), config.batch_size, config.seq_len, seed)
    return data.array_batches(data.load_digits()[0], config.batch_size, seed, "digits training split")


def setup(model: str = "transformer", **fields) -> Setup:
    """`model` from `models/`, configured by `jaxpar.cli.Config(model=model, **fields)` (None values left out: the
    config's defaults), with its loss and the first batch of seed 0."""
    import models

    config = Config(model=model, **{k: v for k, v in fields.items() if v is not None}).resolved()
    return Setup(config, models.factory(config), models.loss_for(config), next(batches(config)))


def trainer(parts: Setup, mesh, optimizer=None, **options) -> jaxpar.Trainer:
    """A `jaxpar.Trainer` of `parts`' model and loss on `mesh` (default optimizer: adamw, lr 1e-3)."""
    import optax

    return jaxpar.Trainer(parts.factory, parts.loss_fn, optimizer or optax.adamw(1e-3), mesh, **options)


def run_steps(step: Callable[[], dict], n: int) -> None:
    """Calls `step()` (one train step, returning its metrics) `n` times with at most two steps in flight, as
    `Trainer.fit` does, and waits for the last."""
    import jax

    previous = None
    for _ in range(n):
        loss = step()["loss"]
        if previous is not None:
            jax.block_until_ready(previous)
        previous = loss
    jax.block_until_ready(previous)


def alternating_rates(steps: dict[str, Callable], rounds: int, per_round: int,
                      warmup: int = 3, runs: bool = False) -> dict[str, list[float]]:
    """steps/s per round of each named step function (`run_steps`): `warmup` steps of each first (compilation),
    then `rounds` rounds of `per_round` steps that alternate the functions in order, so machine noise hits them
    alike. `runs`: the functions are `run(n)`, each running n steps and waiting for the last, instead of steps."""
    run = (lambda f, n: f(n)) if runs else run_steps
    for step in steps.values():
        run(step, warmup)
    rates: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            run(step, per_round)
            rates[name].append(per_round / (time.perf_counter() - start))
    return rates
