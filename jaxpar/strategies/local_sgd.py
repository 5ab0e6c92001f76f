"""Local SGD / periodic averaging, post-local SGD, and DiLoCo.

Each replica keeps its own parameters, model state and optimizer state (arrays with a leading replica dimension
sharded over the replica axis, and over fsdp / model inside like the parameters, in `strategy_state`) and takes
local steps with no communication at all. Every `period` steps the replicas meet:

- `LocalSGD(period=H)`: parameters (and BatchNorm statistics) are averaged (Stich 2019; Lin et al. 2020).
  `local_after=K` is post-local SGD: the first K steps are ordinary synchronous SGD (gradients averaged, every
  replica applies the same update), local steps only after that.
- `DiLoCo(period=H, outer_optimizer=...)`: the averaged change `anchor - mean(replica params)` is a pseudo-gradient
  for an outer optimizer (Nesterov momentum by default, Douillard et al. 2023) that moves the anchor; replicas
  restart from it. With `optax.sgd(1.0)` as outer optimizer DiLoCo is exactly LocalSGD.

`compress=CODEC` (bf16, fp16, int8, powersgd:R; docs/compression.md) compresses what a meeting sends: each replica's
outer gradient `anchor - replica params` (as Streaming DiLoCo quantizes outer gradients), with its error-feedback
residual per replica in `comm_state`; the mean parameters are `anchor - decoded mean`. Post-local SGD's warm-up
steps average their gradients uncompressed (the codec's state holds outer-gradient residuals only).

`state.params` is the anchor: the parameters as of the last meeting (evaluation and `trainer.params` use it).
Metrics of a meeting step include `replica_divergence`: the mean over replicas of ||theta_i - mean theta|| /
||mean theta|| just before averaging.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxpar.parallel.partitioning import communicator_specs, optimizer_shardings, stacked
from jaxpar.train.step import apply_gradients, check_optimizer, step_key
from jaxpar.strategies import replicas as rep
from jaxpar.checks import check_int
from jaxpar.strategies.base import Plan, StrategyBase, Variant
from jaxpar.strategies.clock import Clock, meeting_rounds

SHARDED, BATCH, SAME = rep.SHARDED, rep.BATCH, rep.SAME


class LocalSGD(StrategyBase):
    name = "local_sgd"
    SYNC, LOCAL, MEET = "sync", "local", "meet"  # its step variants: post-local SGD's synchronous one, local, meeting
    DEFAULT_PERIOD = 4  # steps between meetings
    local_statistics = True

    def __init__(self, period: int = DEFAULT_PERIOD, local_after: int = 0, *, allreduce: str | None = None,
                 torus_x: int | None = None, stragglers=None, compress: str | None = None):
        cls = type(self).__name__
        check_int(f"{cls}(period=...)", period, 1, "steps between meetings; 1 = average after every step")
        check_int(f"{cls}(local_after=...)", local_after, 0, "synchronous steps first; 0 = local from the start")
        super().__init__(allreduce, torus_x, stragglers)
        self._compress(compress)  # (the default allreduce is psum: always a hand-written exchange to wrap)
        self.period, self.local_after = period, local_after
        self.clock = Clock(self.stragglers, 0, meeting_rounds(period, local_after))

    # --- state -----------------------------------------------------------------------------------------------
    @classmethod
    def reduce(cls, state):
        """The strategy-free state: each replica's parameters, optimizer and model state averaged over replicas as
        at a meeting (floats); counts and RNG keys agree across replicas, so the anchor's (or replica 0's) stay."""
        own = state.strategy_state

        def average(stacked, anchor):
            if jnp.issubdtype(stacked.dtype, jnp.floating):
                return jnp.mean(stacked, axis=0, dtype=jnp.float32).astype(stacked.dtype)
            return anchor if anchor is not None and anchor.shape == stacked.shape[1:] else stacked[0]

        def part(name, anchor):
            if anchor is None:
                return jax.tree.map(lambda x: average(x, None), own[name])
            return jax.tree.map(average, own[name], anchor)

        return state._replace(params=part("params", None), opt_state=part("opt_state", None),
                              model_state=part("model_state", state.model_state), strategy_state=())

    def _anchor_opt_state(self, ctx, params):
        return ()

    def _anchor_opt_shardings(self, ctx):
        return ()

    def init(self, ctx, state):
        count = ctx.num_replicas
        model_states = [rep.fold_rng_keys(state.model_state, r) for r in range(count)]
        replica = {"params": rep.stack(state.params, count), "opt_state": rep.stack(state.opt_state, count),
                   "model_state": jax.tree.map(lambda *xs: jnp.stack(xs), *model_states)}
        return state._replace(opt_state=self._anchor_opt_state(ctx, state.params), strategy_state=replica)

    def shardings(self, ctx, shardings):
        self.check_against_mesh(ctx)
        replica = {"params": stacked(shardings.params), "opt_state": stacked(shardings.opt_state),
                   "model_state": stacked(shardings.model_state)}
        return shardings._replace(opt_state=self._anchor_opt_shardings(ctx), strategy_state=replica)

    # --- schedule ----------------------------------------------------------------------------------------------
    def plan(self, ctx, step_number: int) -> Plan:
        if step_number < self.local_after:
            variant = self.SYNC
        elif (step_number - self.local_after + 1) % self.period == 0:
            variant = self.MEET
        else:
            variant = self.LOCAL
        return Plan(variant)

    # --- steps -------------------------------------------------------------------------------------------------
    def steps(self, ctx):
        per_replica = self._metrics_out()[1] != SAME
        return {self.LOCAL: Variant(self._local_step(ctx), guards_itself=True, per_replica_metrics=per_replica),
                self.MEET: Variant(self._meet_step(ctx), guards_itself=True, per_replica_metrics=per_replica),
                self.SYNC: Variant(self._sync_step(ctx))}

    def _replica_update(self, ctx, replica, batch, key, average: bool, comm_state=(), mean_metrics=True):
        grads, model_state, metrics, comm_state = rep.replica_step(
            ctx, replica["params"], replica["model_state"], batch, key, average=average, comm_state=comm_state,
            mean_metrics=mean_metrics)
        params, opt_state = apply_gradients(ctx.tx, replica["params"], replica["opt_state"], grads)
        return {"params": params, "opt_state": opt_state, "model_state": model_state}, metrics, comm_state

    def _own_update(self, ctx, replica, batch, key):
        """This replica's local update, checked for non-finite values on its own (no other replica is asked)."""
        old = rep.take_own(replica)
        new, metrics, _ = self._replica_update(ctx, old, batch, key, average=False, mean_metrics=False)
        return rep.guard_finite(ctx, old, new, metrics)

    @staticmethod
    def _metrics_out():
        """(how a step's per-replica metrics leave the replica, their out spec). One process holds every replica:
        they stay per replica ([R]) and the host averages them. With several processes a process could not read
        the others' replicas, so the scalars are averaged on the device (one small all-reduce)."""
        if jax.process_count() == 1:
            return (lambda metrics: {k: v[None] for k, v in metrics.items()}), SHARDED
        return rep.native_mean, SAME

    def _local_step(self, ctx):
        report, metrics_spec = self._metrics_out()

        def own(replica, batch, key):
            new, metrics = self._own_update(ctx, replica, batch, key)
            return rep.as_own(new), report(metrics)

        sharded = rep.per_replica(ctx, own, in_specs=(SHARDED, BATCH, SAME), out_specs=(SHARDED, metrics_spec))

        def step(state, batch, inputs):
            # nothing crosses the replica axis: each replica's metrics ([R]) and its own non-finite check
            replica, metrics = sharded(state.strategy_state, batch, step_key(state))
            return state._replace(step=state.step + 1, strategy_state=replica), metrics

        return step

    def _sync_step(self, ctx):
        # post-local SGD's warm-up averages gradients uncompressed, leaving the codec's state (the residuals of
        # outer gradients, another quantity) alone: docs/compression.md, "At local SGD / DiLoCo meetings"
        compressing = _codec(ctx.communicator) is not None
        if compressing:
            ctx = ctx._replace(communicator=ctx.communicator.base)

        def own(replica, anchor_model_state, batch, key, comm_state):
            replica, metrics, comm_state = self._replica_update(ctx, rep.take_own(replica), batch, key, True,
                                                                comm_state)
            anchor = (replica["params"], rep.unfold_rng_keys(replica["model_state"], anchor_model_state))
            return rep.as_own(replica), anchor, metrics, comm_state

        sharded = rep.per_replica(ctx, own, in_specs=(SHARDED, SAME, BATCH, SAME, SAME),
                                  out_specs=(SHARDED, SAME, SAME, SAME))

        def step(state, batch, inputs):
            replica, (params, model_state), metrics, comm_state = sharded(
                state.strategy_state, state.model_state, batch, step_key(state), () if compressing else state.comm_state)
            comm_state = state.comm_state if compressing else comm_state
            return state._replace(step=state.step + 1, params=params, model_state=model_state,
                                  strategy_state=replica, comm_state=comm_state), metrics

        return step

    def _meet_step(self, ctx):
        report, metrics_spec = self._metrics_out()

        def own(replica, anchor_params, anchor_opt_state, anchor_model_state, batch, key, comm_state):
            # a replica whose own step is not finite brings its previous copy to the meeting (it is checked alone,
            # so the meeting's only collective over data is the average itself)
            old = rep.take_own(replica)
            replica, metrics = self._own_update(ctx, replica, batch, key)
            mean_params, outer_grad, new_comm = self._average(ctx, anchor_params, replica["params"], comm_state)
            distance = jnp.sqrt(rep.tree_sq_norm(jax.tree.map(jnp.subtract, replica["params"], mean_params)))
            divergence = distance / jnp.sqrt(rep.tree_sq_norm(mean_params))
            params, opt_state = self._outer_update(ctx, anchor_params, anchor_opt_state, mean_params, outer_grad)
            model_state = rep.mean_batch_stats(replica["model_state"])
            replica = {"params": params, "opt_state": replica["opt_state"], "model_state": model_state}
            anchor = (params, opt_state, rep.unfold_rng_keys(model_state, anchor_model_state))
            # the meeting's result (the same on every replica: no collective needed to agree on it) must be finite
            # too, e.g. an outer step that overflows; if not, the whole meeting is skipped (or flagged), the codec's
            # state (error-feedback residuals, PowerSGD's Q) included
            before = (anchor_params, anchor_opt_state, anchor_model_state)
            ((replica, comm_state), anchor), metrics = rep.guard_meeting(ctx, ((old, comm_state), before),
                                                                         ((replica, new_comm), anchor), metrics)
            return rep.as_own(replica), anchor, report({**metrics, "replica_divergence": divergence}), comm_state

        def step(state, batch, inputs):
            comm = communicator_specs(state.comm_state)  # a codec's per-replica residuals: one per replica
            sharded = rep.per_replica(ctx, own, in_specs=(SHARDED, SAME, SAME, SAME, BATCH, SAME, comm),
                                      out_specs=(SHARDED, SAME, metrics_spec, comm))
            replica, (params, opt_state, model_state), metrics, comm_state = sharded(
                state.strategy_state, state.params, state.opt_state, state.model_state, batch, step_key(state),
                state.comm_state)
            return state._replace(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state,
                                  strategy_state=replica, comm_state=comm_state), metrics

        return step

    @staticmethod
    def _average(ctx, anchor_params, params, comm_state):
        """Inside `per_replica`: (mean parameters, the mean outer gradient or None, comm_state). Uncompressed, the
        parameters themselves are averaged (today's meeting, bit for bit); with a codec, each replica's outer gradient
        `anchor - params` is, and the mean parameters are `anchor - that mean`."""
        if _codec(ctx.communicator) is None:
            mean_params, comm_state = rep.mean_params_like(ctx, params, comm_state)
            return mean_params, None, comm_state
        delta = jax.tree.map(jnp.subtract, anchor_params, params)
        outer_grad, comm_state = rep.mean_params_like(ctx, delta, comm_state)
        return jax.tree.map(jnp.subtract, anchor_params, outer_grad), outer_grad, comm_state

    def _outer_update(self, ctx, anchor_params, anchor_opt_state, mean_params, outer_grad=None):
        return mean_params, anchor_opt_state


class DiLoCo(LocalSGD):
    name = "diloco"
    DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM = 0.7, 0.9  # the default outer optimizer: Nesterov SGD with these

    def __init__(self, period: int = LocalSGD.DEFAULT_PERIOD,
                 outer_optimizer: optax.GradientTransformation | None = None, *,
                 local_after: int = 0, allreduce: str | None = None, torus_x: int | None = None, stragglers=None,
                 compress: str | None = None):
        super().__init__(period, local_after, allreduce=allreduce, torus_x=torus_x, stragglers=stragglers,
                         compress=compress)
        if outer_optimizer is not None:
            check_optimizer("DiLoCo(outer_optimizer=...)", outer_optimizer)
        self.outer_tx = outer_optimizer or optax.sgd(self.DEFAULT_OUTER_LR, momentum=self.DEFAULT_OUTER_MOMENTUM,
                                                     nesterov=True)

    def _anchor_opt_state(self, ctx, params):
        return self.outer_tx.init(params)

    def _anchor_opt_shardings(self, ctx):
        abstract = jax.eval_shape(self.outer_tx.init, ctx.abstract_params)
        return optimizer_shardings(self.outer_tx, abstract, ctx.param_shardings, ctx.mesh)

    def _outer_update(self, ctx, anchor_params, anchor_opt_state, mean_params, outer_grad=None):
        # compressed: the decoded mean outer gradient itself (anchor - (anchor - g) would round g once more)
        pseudo_grad = jax.tree.map(jnp.subtract, anchor_params, mean_params) if outer_grad is None else outer_grad
        return apply_gradients(self.outer_tx, anchor_params, anchor_opt_state, pseudo_grad)


def _codec(communicator):
    """The codec a (compressed) communicator wraps its exchange in, or None."""
    return getattr(communicator, "codec", None)
