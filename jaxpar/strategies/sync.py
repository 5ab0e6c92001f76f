"""Synchronous data parallelism (BSP): every step applies the gradient of the loss over the whole global batch.

The batch is split over the `data` axis and the parameters over `model`; XLA's partitioner inserts the all-reduce
that averages gradients over `data` (this is what `jax.jit` with `NamedSharding`, formerly `pjit`, does). Every
replica therefore holds identical parameters after every step, and the result equals one device running the
global batch.
"""

from __future__ import annotations

from jaxpar.step import TrainState, apply_gradients, loss_and_grad


class Sync:
    name = "sync"

    def init(self, ctx, state):
        return ()

    def state_shardings(self, ctx, abstract_state):
        return ()

    def make_step(self, ctx):
        def step(state: TrainState, batch):
            loss, metrics, model_state, grads = loss_and_grad(
                ctx.graphdef, ctx.loss_fn, state.params, state.model_state, batch)
            params, opt_state = apply_gradients(ctx.tx, state.params, state.opt_state, grads)
            new_state = TrainState(state.step + 1, params, model_state, opt_state, state.strategy_state)
            return new_state, {"loss": loss, **metrics}

        return step
