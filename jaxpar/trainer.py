"""Trainer: init / step / evaluate / fit for any Flax NNX model on a ("data", "model") mesh.

    import jaxpar, optax
    trainer = jaxpar.Trainer(model=lambda rngs: MyModel(rngs=rngs), loss_fn=my_loss,
                             optimizer=optax.adamw(1e-3), mesh=jaxpar.make_mesh("2x4"))
    state = trainer.init(seed=0)
    state, metrics = trainer.step(state, {"x": x_np, "y": y_np})
    params = trainer.params(state)

Parameters and optimizer state are created already sharded: the model is built abstractly (`nnx.eval_shape`), its
logical axis names are mapped to `NamedSharding`s, and the real values are created inside
`jax.jit(init, out_shardings=...)`, so no device ever holds a whole tensor-parallel parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxpar import sharding as shd
from jaxpar.errors import ConfigError, JaxparError
from jaxpar.step import LossFn, TrainState, evaluate_batch, split_model
from jaxpar.strategies import StepContext, Strategy, Sync


class Trainer:
    def __init__(self, model: Callable[[nnx.Rngs], nnx.Module], loss_fn: LossFn,
                 optimizer: optax.GradientTransformation, mesh: Mesh,
                 rules: Mapping[str, str | None] = shd.DEFAULT_RULES, strategy: Strategy | None = None,
                 grad_accum: int = 1, eval_loss_fn: LossFn | None = None):
        self.mesh, self.rules, self.strategy = mesh, dict(rules), strategy or Sync()
        self._factory, self._loss_fn, self._tx, self.grad_accum = model, loss_fn, optimizer, grad_accum
        self._eval_loss_fn = eval_loss_fn or loss_fn  # e.g. the loss without label smoothing
        if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
            raise ConfigError(f"--grad-accum {grad_accum!r}: must be an integer >= 1")
        shd.validate_rules(self.rules, mesh)

        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(lambda: model(nnx.Rngs(0)))
        abstract.eval()
        self._eval_graphdef = split_model(abstract)[0]
        abstract.train()
        graphdef, abs_params, abs_model_state = split_model(abstract)

        param_sh = shd.state_shardings(abs_params, self.rules, mesh)
        model_state_sh = shd.state_shardings(abs_model_state, self.rules, mesh)
        opt_sh = shd.optimizer_shardings(optimizer, jax.eval_shape(optimizer.init, abs_params), param_sh, mesh)
        self._ctx = StepContext(graphdef, abs_params, loss_fn, optimizer, mesh, param_sh, model_state_sh, opt_sh,
                                grad_accum)
        base = TrainState(shd.replicated(mesh), param_sh, model_state_sh, opt_sh, ())
        self.state_shardings = self.strategy.shardings(self._ctx, base)
        self.batch_sharding = shd.batch_sharding(mesh)
        self.trace_counts: dict[str, int] = {}  # traces (= compilations) per step variant; 1 each in a healthy run

        self._init = jax.jit(self._init_state, out_shardings=self.state_shardings)
        self._steps = {name: jax.jit(functools.partial(self._traced_step, name, fn),
                                     in_shardings=(self.state_shardings, self.batch_sharding, None),
                                     out_shardings=(self.state_shardings, shd.replicated(mesh)), donate_argnums=0)
                       for name, fn in self.strategy.steps(self._ctx).items()}
        self._eval = jax.jit(self._eval_step, in_shardings=(self.state_shardings, self.batch_sharding),
                             out_shardings=shd.replicated(mesh))

    # --- pure functions (jitted above) ---------------------------------------------------------------------------
    def _init_state(self, seed) -> TrainState:
        with nnx.use_eager_sharding(False):
            model = self._factory(nnx.Rngs(jax.random.key(seed)))
        _, params, model_state = split_model(model)
        state = TrainState(jnp.zeros((), jnp.int32), params, model_state, self._tx.init(params), ())
        return self.strategy.init(self._ctx, state)

    def _traced_step(self, name, fn, state, batch, inputs):
        self.trace_counts[name] = self.trace_counts.get(name, 0) + 1
        return fn(state, batch, inputs)

    def _eval_step(self, state, batch):
        return evaluate_batch(self._eval_graphdef, self._eval_loss_fn, state.params, state.model_state, batch)

    # --- public API ----------------------------------------------------------------------------------------------
    @property
    def trace_count(self) -> int:
        return sum(self.trace_counts.values())

    @property
    def data_size(self) -> int:
        return self.mesh.shape["data"]

    def init(self, seed: int = 0) -> TrainState:
        """A fresh train state; the same seed gives the same parameters on every mesh."""
        return self._init(jnp.asarray(seed, jnp.uint32))

    def shard_batch(self, batch: Mapping[str, np.ndarray | jax.Array]) -> dict[str, jax.Array]:
        """Places a global batch on the mesh, examples split over `data` (a no-op for arrays already placed)."""
        sizes = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in batch.items()}
        if None in sizes.values() or len(set(sizes.values())) != 1:
            raise JaxparError(f"batch arrays must share a leading example dimension; got leading sizes {sizes}")
        size = next(iter(sizes.values()))
        if size % self.data_size:
            raise JaxparError(f"global batch size {size} does not divide by the data-axis size {self.data_size}; "
                              f"use a multiple of {self.data_size} (--batch-size)")
        return {k: v if isinstance(v, jax.Array) and v.sharding == self.batch_sharding else self._place(v)
                for k, v in batch.items()}

    def _place(self, rows):
        if jax.process_count() == 1:
            return jax.device_put(rows, self.batch_sharding)
        # several processes: each holds only its rows of the global batch (see jaxpar.data.process_rows)
        return jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(rows))

    def step(self, state: TrainState, batch, step_number: int | None = None
             ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One update; `state` is donated (do not reuse it). Metrics stay on device until read.

        `step_number` (the number of updates already applied) lets the strategy plan the step without reading
        `state.step` back from the device; `fit` passes it.
        """
        sizes = {np.shape(v)[0] for v in batch.values() if np.ndim(v)}
        if any((size // self.data_size) % self.grad_accum for size in sizes):
            size = next(iter(sizes))
            raise JaxparError(f"--grad-accum {self.grad_accum} does not divide the per-replica batch "
                              f"{size // self.data_size} (global {size} / data axis {self.data_size}); use a divisor "
                              f"of {size // self.data_size}")
        if step_number is None:
            step_number = int(jax.device_get(state.step))
        plan = self.strategy.plan(self._ctx, step_number)
        state, metrics = self._steps[plan.variant](state, self.shard_batch(batch), plan.inputs)
        return state, {**metrics, **plan.host_metrics}

    def evaluate(self, state: TrainState, batch) -> dict[str, jax.Array]:
        """`loss_fn`'s metrics in eval mode (no dropout, BatchNorm running averages) on one global batch."""
        return self._eval(state, self.shard_batch(batch))

    def params(self, state: TrainState) -> dict:
        """The full parameters, gathered from all shards, as a nested dict of numpy arrays."""
        return jax.tree.map(np.asarray, nnx.to_pure_dict(jax.device_get(state.params)))

    def fit(self, state: TrainState, batches: Iterable[Mapping], steps: int,
            on_step: Callable[[int, dict[str, float]], None] | None = None) -> TrainState:
        """Runs `steps` updates, calling `on_step(step, metrics)` with host floats after each.

        At most two steps are in flight: before dispatching step N+1 the loop waits for step N-1's metrics.
        Unbounded dispatch of collective-bearing steps deadlocks XLA:CPU with many devices on few cores, and
        reading metrics one step late still overlaps host work with the device.
        """
        iterator = iter(batches)
        step_number = int(jax.device_get(state.step))  # counted on the host: state.step is donated each step
        pending = None
        for _ in range(steps):
            state, metrics = self.step(state, next(iterator), step_number)
            step_number += 1
            if pending is not None:
                self._report(*pending, on_step)
            pending = (step_number, metrics)
        if pending is not None:
            self._report(*pending, on_step)
        return state

    @staticmethod
    def _report(step, metrics, on_step):
        host = jax.device_get(metrics)  # blocks until that step is done
        if on_step is not None:
            on_step(step, {k: float(v) for k, v in host.items()})
