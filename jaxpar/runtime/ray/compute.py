"""A worker's JAX side: its own Trainer on its own mesh (the run's non-data axes), the gradient of one batch on the
parameters it was handed, or H local steps from them (local SGD / DiLoCo); parameters in and gradients out as flat
lists of numpy arrays (the leaves of the model's `nnx.Param` state, in `jax.tree.leaves` order)."""

from __future__ import annotations

import jax
import numpy as np

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.train.step import loss_and_grad
from jaxpar.train.trainer import Trainer


def build_trainer(spec, mesh_spec: str, optimizer) -> Trainer:
    """A Trainer of the spec's model on `mesh_spec` (this process's devices), synchronous within itself."""
    return Trainer(model=spec.model, loss_fn=spec.loss_fn, optimizer=optimizer, mesh=mesh_lib.make_mesh(mesh_spec),
                   rules=spec.rules, grad_accum=spec.grad_accum, skip_nonfinite=spec.skip_nonfinite)


def leaves_of(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


class WorkerCompute:
    """One worker's computations (see the module docstring)."""

    def __init__(self, spec, worker: int):
        self.spec, self.worker = spec, worker
        self.trainer = trainer = build_trainer(spec, spec.worker_mesh, spec.optimizer)
        self.state = trainer.init(spec.seed)  # model state (RNG counters, statistics) and the inner optimizer's
        self._treedef = jax.tree.structure(self.state.params)
        self._param_shardings = trainer.state_shardings.params
        ctx = trainer.ctx
        grad = lambda params, model_state, batch, key: loss_and_grad(ctx.graphdef, ctx.loss_fn, params, model_state,
                                                                     batch, key, ctx.grad_accum)
        self._grad = mesh_lib.in_mesh(jax.jit(grad), trainer.mesh)

    def _params(self, leaves):
        return jax.device_put(jax.tree.unflatten(self._treedef, leaves), self._param_shardings)

    def key(self, seq: int):
        """The key of batch `seq`: the emulation's (run key, step, replica) when seq is the update number."""
        run_key = jax.random.wrap_key_data(self.state.key)
        return jax.random.fold_in(jax.random.fold_in(run_key, seq), self.worker)

    def gradient(self, leaves, batch, seq: int) -> tuple[float, list[np.ndarray]]:
        """(loss, gradient leaves) of this worker's batch on the parameters `leaves`."""
        placed = self.trainer.shard_batch(batch)
        loss, _, model_state, grads = self._grad(self._params(leaves), self.state.model_state, placed, self.key(seq))
        self.state = self.state._replace(model_state=model_state)
        return float(loss), leaves_of(grads)

    def local_steps(self, leaves, batches) -> tuple[float, list[np.ndarray]]:
        """(mean loss, change = start - end parameters) of len(batches) local steps from `leaves` with the inner
        optimizer, whose state this worker keeps across rounds."""
        start = [np.array(x) for x in leaves]
        state = self.state._replace(params=self._params(leaves))
        losses = []
        for batch in batches:
            state, metrics = self.trainer.step(state, batch)
            losses.append(float(metrics["loss"]))
        self.state = state
        end = leaves_of(state.params)
        return float(np.mean(losses)), [s - e for s, e in zip(start, end)]
