"""Synchronous data parallelism (BSP): every step applies the gradient of the loss over the whole global batch.

- `Sync()`: `jax.jit` with `NamedSharding` (what pjit became). XLA's partitioner inserts the all-reduce that averages
  gradients over `data`; dropout masks are drawn for the global batch and BatchNorm sees the global batch, so the
  run is exactly the single-device run, whatever the mesh.
- `Sync(allreduce="psum" | "ring" | "torus2d" | "ps")`: the gradient average is explicit, inside a `shard_map` manual
  over `data` (model left to the compiler), with the chosen algorithm from `jaxpar.collectives`. Each replica
  draws its own dropout masks (its index folded into the key) and BatchNorm uses its own slice's statistics, with
  running averages averaged so replicas stay identical.

Every replica holds identical parameters after every step; a slow replica holds everyone back (the simulated
clock, with `stragglers`, charges each step the slowest replica's time).
"""

from __future__ import annotations

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.collectives import ALLREDUCE_ALGORITHMS, allreduce_mean, torus_shape
from jaxpar.errors import ConfigError
from jaxpar.step import TrainState, apply_gradients, loss_and_grad
from jaxpar.strategies import replicas as rep
from jaxpar.strategies.base import Plan
from jaxpar.strategies.simulator import Stragglers, bsp_times, parse_stragglers


def check_allreduce(allreduce, torus_x):
    if allreduce is not None and allreduce not in ALLREDUCE_ALGORITHMS:
        raise ConfigError(f"--allreduce {allreduce!r} is not one of: {', '.join(ALLREDUCE_ALGORITHMS)}")
    if torus_x is not None and allreduce != "torus2d":
        raise ConfigError(f"--torus {torus_x} applies only to --allreduce torus2d")


def check_against_mesh(ctx, stragglers: Stragglers, allreduce, torus_x) -> None:
    """The checks that need the data-axis size, run when the trainer is built (before anything compiles)."""
    stragglers.check(ctx.num_replicas)
    if allreduce == "torus2d":
        torus_shape(ctx.num_replicas, torus_x)


def as_stragglers(stragglers) -> Stragglers:
    return stragglers if isinstance(stragglers, Stragglers) else parse_stragglers(stragglers)


class SimulatedClock:
    """Host-side simulated seconds after each step for replicas that meet every step for the first `sync_steps`
    steps and every `period` steps after that (sync SGD: period 1; post-local SGD: sync_steps = K)."""

    def __init__(self, stragglers, period: int = 1, sync_steps: int = 0):
        self.stragglers, self.period, self.sync_steps = as_stragglers(stragglers), period, sync_steps
        self._times = np.zeros(0)

    def time_after(self, num_replicas: int, step_number: int) -> float:
        if step_number >= len(self._times):  # extended geometrically; a pure function of the step number
            total = max(2 * step_number + 1, 1024, self.sync_steps + 1)
            synced = bsp_times(self.stragglers, num_replicas, self.sync_steps, 1)
            start = synced[-1] if len(synced) else 0.0
            local = start + bsp_times(self.stragglers, num_replicas, total - self.sync_steps, self.period)
            self._times = np.concatenate([synced, local])
        return float(self._times[step_number])


class Sync:
    name = "sync"
    OPTIONS: dict = {}  # config fields specific to this strategy -> their defaults (see strategies/__init__.py)

    @property
    def local_statistics(self) -> bool:
        """Replicas compute on their own slice (shard_map), so BatchNorm statistics are per replica."""
        return self.allreduce is not None

    def __init__(self, allreduce: str | None = None, *, torus_x: int | None = None, stragglers=None):
        check_allreduce(allreduce, torus_x)
        self.allreduce, self.torus_x = allreduce, torus_x
        self.clock = SimulatedClock(stragglers)

    def init(self, ctx, state):
        return state

    def shardings(self, ctx, shardings):
        check_against_mesh(ctx, self.clock.stragglers, self.allreduce, self.torus_x)
        return shardings

    def plan(self, ctx, step_number: int) -> Plan:
        return Plan("sync", {}, {"sim_time": self.clock.time_after(ctx.num_replicas, step_number)})

    def steps(self, ctx):
        return {"sync": self._compiler_step(ctx) if self.allreduce is None else self._explicit_step(ctx)}

    def _compiler_step(self, ctx):
        def step(state: TrainState, batch, inputs):
            loss, metrics, model_state, grads = loss_and_grad(
                ctx.graphdef, ctx.loss_fn, state.params, state.model_state, batch, ctx.grad_accum)
            params, opt_state = apply_gradients(ctx.tx, state.params, state.opt_state, grads)
            return state._replace(step=state.step + 1, params=params, model_state=model_state,
                                  opt_state=opt_state), {"loss": loss, **metrics}

        return step

    def _explicit_step(self, ctx):
        algorithm, torus_x = self.allreduce, self.torus_x

        def replica_grads(params, model_state, batch):
            own_state = rep.fold_rng_keys(model_state, rep.replica_index())
            loss, metrics, new_state, grads = loss_and_grad(
                ctx.graphdef, ctx.loss_fn, params, own_state, batch, ctx.grad_accum)
            grads = rep.average_params_like(ctx, grads, algorithm, torus_x)
            new_state = rep.mean_float_state(rep.unfold_rng_keys(new_state, model_state), algorithm, torus_x)
            metrics = allreduce_mean({"loss": loss, **metrics}, "data", "psum")
            return grads, new_state, metrics

        sharded = rep.per_replica(ctx, replica_grads, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()))

        def step(state: TrainState, batch, inputs):
            grads, model_state, metrics = sharded(state.params, state.model_state, batch)
            params, opt_state = apply_gradients(ctx.tx, state.params, state.opt_state, grads)
            return state._replace(step=state.step + 1, params=params, model_state=model_state,
                                  opt_state=opt_state), metrics

        return step
