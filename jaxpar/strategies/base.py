"""The contract between the trainer and a strategy.

A strategy turns the model's loss into a step `step(state, batch) -> (state, metrics)`. It keeps no hidden state:
whatever it needs between steps lives in `TrainState.strategy_state`, created by `init` and sharded as
`state_shardings` says, so it is jitted, donated and checkpointed with the rest of the state.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import optax
from jax.sharding import Mesh

from jaxpar.step import LossFn, TrainState


class StepContext(NamedTuple):
    """What a strategy may use to build its step: all static, all decided by the trainer."""

    graphdef: Any  # the model's structure in train mode
    loss_fn: LossFn
    tx: optax.GradientTransformation
    mesh: Mesh
    param_shardings: Any  # NamedShardings of the params pytree
    opt_shardings: Any  # NamedShardings of the optimizer state


class Strategy(Protocol):
    name: str

    def init(self, ctx: StepContext, state: TrainState) -> Any:
        """The strategy's own state, built inside the jitted initialisation from a fresh train state."""

    def state_shardings(self, ctx: StepContext, abstract_state: TrainState) -> Any:
        """NamedShardings for what `init` returns."""

    def make_step(self, ctx: StepContext):
        """A pure function `step(state, batch) -> (state, metrics)`; the trainer jits it once."""
