"""Synchronous data parallelism (BSP): every step applies the gradient of the loss over the whole global batch.

- `Sync()`: `jax.jit` with `NamedSharding` (what pjit became). XLA's partitioner inserts the gradient all-reduce over
  the gradient axes (data, fsdp) and, with FSDP, the parameter all-gathers and gradient reduce-scatters; dropout
  masks are drawn for the global batch and BatchNorm sees the global batch, so the run is exactly the
  single-device run, whatever the mesh.
- `Sync(allreduce="psum" | "ring" | "torus2d" | "ps")`: the gradient average over replicas is explicit, inside a
  `shard_map` manual over the replica axis (fsdp and model left to the compiler), with the chosen communicator.
  Each replica draws its own dropout masks (its index folded into the key) and BatchNorm uses its own slice's
  statistics, with running averages averaged so replicas stay identical.
- `Sync(allreduce=..., compress="bf16" | "fp16" | "int8" | "powersgd:R")`: that exchange wrapped by a codec
  (`jaxpar.parallel.compression`; docs/compression.md), its state (error-feedback residuals) in `comm_state`;
  with fsdp > 1 the same codec compresses the gradient's reduce-scatter over fsdp (`jaxpar.parallel.fsdp_reduce`).

Every replica holds identical parameters after every step; a slow replica holds everyone back (the simulated
clock, with `stragglers`, charges each step the slowest replica's time).
"""

from __future__ import annotations


from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.partitioning import communicator_specs, constrain, gathered_over
from jaxpar.strategies import replicas as rep
from jaxpar.strategies.base import Plan, StrategyBase, Variant
from jaxpar.strategies.clock import Clock
from jaxpar.train.faults import guarded_update, keep_unless
from jaxpar.train.step import TrainState, loss_and_grad, step_key


class Sync(StrategyBase):
    name = "sync"
    SYNC = "sync"  # its one step variant
    DEFAULT_ALLREDUCE = None  # the partitioner's: one jit step over the whole global batch

    def __init__(self, allreduce: str | None = None, *, torus_x: int | None = None, stragglers=None,
                 compress: str | None = None):
        super().__init__(allreduce, torus_x, stragglers)
        self._compress(compress)
        self.clock = Clock(self.stragglers, 0, lambda update: (self.SYNC,))

    @property
    def local_statistics(self) -> bool:
        """Explicit allreduce: replicas compute on their own slice (shard_map), so BatchNorm statistics are local."""
        return self.communicator is not None

    def fsdp_leg_codec(self, variant: str):
        """The codec of the gradient's fsdp leg in `variant` (`jaxpar.strategies.replicas.fsdp_leg_codec`): the
        explicit step's, which averages its gradient with the codec."""
        return getattr(self.communicator, "codec", None)

    def init(self, ctx, state):
        return state

    @classmethod
    def reduce(cls, state):
        return state

    def shardings(self, ctx, shardings):
        self.check_against_mesh(ctx)
        return shardings

    def plan(self, ctx, step_number: int) -> Plan:
        return Plan(self.SYNC)

    def steps(self, ctx):
        # The default stays the compiler's step on every mesh, also on several CPU processes where XLA:CPU sends
        # each gradient array of its combined all-reduce as its own gloo call: the explicit per-replica step would
        # send one flat buffer but changes the math (per-replica dropout masks; a mean of per-replica losses is the
        # global loss only for a plain mean over examples). docs/processes.md, "Measured".
        # both check the update before applying it (`guarded_update`): no collective over data for the guard
        step = self._compiler_step(ctx) if self.communicator is None else self._explicit_step(ctx)
        return {self.SYNC: Variant(step, guards_itself=True)}

    def _compiler_step(self, ctx):
        zero3 = mesh_lib.size(ctx.mesh, mesh_lib.FSDP_AXIS) > 1
        gathered = gathered_over(ctx.param_shardings, mesh_lib.FSDP_AXIS) if zero3 else None

        def step(state: TrainState, batch, inputs):
            params = state.params
            if zero3:
                # ZeRO-3: use the parameters whole over fsdp (all-gathered), keep their gradients split like the
                # stored parameters (reduce-scattered). Left alone, the partitioner splits each matmul over the
                # fsdp-sharded contracting dimension and moves activations instead: 12-24x the bytes (measured).
                params = constrain(params, gathered)
            loss, metrics, model_state, grads = loss_and_grad(
                ctx.graphdef, ctx.loss_fn, params, state.model_state, batch, step_key(state), ctx.grad_accum)
            if zero3:
                grads = constrain(grads, ctx.param_shardings)
            new = guarded_update(ctx, state, grads, model_state, {"loss": loss, **metrics})
            return state._replace(step=state.step + 1, params=new.params, model_state=new.model_state,
                                  opt_state=new.opt_state), new.metrics

        return step

    def _explicit_step(self, ctx):
        def own(params, model_state, batch, key, comm_state):
            return rep.replica_step(ctx, params, model_state, batch, key, comm_state=comm_state)

        same = rep.SAME

        def step(state: TrainState, batch, inputs):
            comm = communicator_specs(state.comm_state)  # a codec's per-replica residuals: one per replica
            sharded = rep.per_replica(ctx, own, in_specs=(same, same, rep.BATCH, same, comm),
                                      out_specs=(same, same, same, comm))
            grads, model_state, metrics, comm_state = sharded(state.params, state.model_state, batch,
                                                              step_key(state), state.comm_state)
            new = guarded_update(ctx, state, grads, model_state, metrics)
            return state._replace(step=state.step + 1, params=new.params, model_state=new.model_state,
                                  opt_state=new.opt_state,
                                  comm_state=keep_unless(ctx, new.ok, comm_state, state.comm_state)), new.metrics

        return step
