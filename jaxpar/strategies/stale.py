"""Stale-synchronous (SSP) and asynchronous (ASP) updates, emulated exactly on an SPMD mesh.

One SPMD program cannot let replicas run out of step, so the parameter-server semantics are replayed: a host-side
event simulation (`simulation.simulate`, deterministic from the straggler profile and its seed) decides for every
server update which replicas deliver a gradient and on which past parameter version each was computed. The device
keeps the last B versions of the parameters in a ring buffer (sharded like the parameters); each replica reads the
version it was assigned, computes its gradient on its slice of the batch, and the server applies the mean of the
delivered gradients to the current parameters. Replicas that deliver nothing are masked out (they still compute:
an SPMD program runs every replica). Time is simulated; this is an exact emulation of the update rule, not
wall-clock asynchrony.

- `SSP(staleness=S)`: no delivered gradient is more than S updates stale (B = S + 1). S = 0 is BSP = sync SGD.
- `ASP()`: never waits; B is the schedule's largest staleness + 1 over `horizon` updates (refused up front if the
  buffer would not fit in device memory).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import JaxparError, OptionError
from jaxpar.parallel.partitioning import bytes_per_device, stacked
from jaxpar.runtime.resources import device_memory
from jaxpar.train.faults import guarded_update, keep_unless
from jaxpar.train.step import step_key
from jaxpar.strategies import replicas as rep
from jaxpar.checks import check_int
from jaxpar.strategies.base import Plan, StrategyBase, Variant
from jaxpar.strategies.clock import Clock
from jaxpar.strategies.simulation import MAX_SIMULATED_UPDATES, check_update_count


class SSP(StrategyBase):
    name = "ssp"
    UPDATE = "update"  # its one step variant: a server update
    local_statistics = True
    bounded = True  # staleness is bounded (ASP: None)

    @classmethod
    def reduce(cls, state):
        return state._replace(strategy_state=())

    def __init__(self, staleness: int = 2, *, stragglers=None, allreduce: str | None = None, torus_x: int | None = None,
                 horizon: int = 10_000, max_buffer_bytes: int | None = None):
        cls = type(self).__name__
        if self.bounded:  # ASP passes None: no bound
            check_int(f"{cls}(staleness=...)", staleness, 0, "0 = BSP = sync SGD")
        check_int(f"{cls}(horizon=...)", horizon, 1, "the number of updates to plan")
        check_int(f"{cls}(max_buffer_bytes=...)", max_buffer_bytes, 1, "None = half the device memory", optional=True)
        super().__init__(allreduce, torus_x, stragglers)
        self.bound, self.horizon, self.max_buffer_bytes = staleness, horizon, max_buffer_bytes
        self.clock = Clock(self.stragglers, staleness, lambda update: (self.UPDATE,))
        self._buffers: dict[int, int] = {}  # replica count -> B

    # --- host-side schedule (pure functions of the replica count, memoised) --------------------------------------
    def schedule(self, num_replicas: int, updates: int):
        """The simulated updates; a longer request re-simulates, and the prefix is identical."""
        known = self.clock.schedule(num_replicas, 0)
        if len(known) < updates:  # grows geometrically past the horizon
            length = max(updates, min(max(self.horizon, 2 * len(known)), MAX_SIMULATED_UPDATES))
            check_update_count(length)
            known = self.clock.schedule(num_replicas, length)
        return known

    @property
    def bounded_buffer(self) -> int | None:
        """B under a staleness bound: min(S, horizon) + 1, since staleness never exceeds the number of updates
        planned (SSP(20000) planned for 64 updates keeps 65 versions); None for ASP, whose B comes from its
        schedule."""
        return None if self.bound is None else min(self.bound, self.horizon) + 1

    def buffer_size(self, num_replicas: int) -> int:
        """B: `bounded_buffer` for SSP; for ASP the largest staleness within the first `horizon` updates + 1."""
        if num_replicas not in self._buffers:
            check_update_count(self.horizon)  # the schedule is simulated up front: refused before anything runs
            if self.bound is not None:
                self._buffers[num_replicas] = self.bounded_buffer
            else:
                horizon = self.schedule(num_replicas, self.horizon)[:self.horizon]
                self._buffers[num_replicas] = int(max(u.staleness.max() for u in horizon)) + 1
        return self._buffers[num_replicas]

    def plan(self, ctx, step_number: int) -> Plan:
        replicas = ctx.num_replicas
        update = self.schedule(replicas, step_number + 1)[step_number]
        buffer = self.buffer_size(replicas)
        stale = update.staleness[update.participants]
        if stale.max() >= buffer:
            raise JaxparError(f"{self.name}: update {step_number} needs a version {stale.max()} updates old but the "
                              f"buffer holds {buffer}; plan at least as many updates as you train (horizon)")
        inputs = {"participation": update.participants.astype(np.float32),
                  "staleness": update.staleness.astype(np.int32)}
        return Plan(self.UPDATE, inputs, {"staleness_mean": float(stale.mean()),
                                       "staleness_max": float(stale.max()), "contributors": float(len(stale)),
                                       "version_buffer": float(buffer)},
                    work_fraction=len(stale) / replicas)

    # --- state ---------------------------------------------------------------------------------------------------
    def init(self, ctx, state):
        buffer = self.buffer_size(ctx.num_replicas)
        versions = jax.tree.map(lambda x: jnp.broadcast_to(x, (buffer,) + x.shape), state.params)
        return state._replace(strategy_state={"versions": versions, "version": jnp.zeros((), jnp.int32)})

    def shardings(self, ctx, shardings):
        self.check_against_mesh(ctx)
        buffer = self.buffer_size(ctx.num_replicas)
        self._check_memory(ctx, buffer)
        versions = stacked(shardings.params, over_replicas=False)
        return shardings._replace(strategy_state={"versions": versions, "version": shardings.step})

    def _check_memory(self, ctx, buffer):
        per_device = bytes_per_device(ctx.abstract_params, ctx.param_shardings)
        limit = self.max_buffer_bytes if self.max_buffer_bytes is not None else device_memory(ctx.mesh) // 2
        if buffer * per_device > limit:
            raise OptionError("strategy", self.name, f"the schedule's largest staleness is {buffer - 1}, so the "
                              f"parameter-version buffer needs {buffer} x {per_device:,} bytes per device, more than "
                              f"the {limit:,} bytes allowed; bound it with strategy ssp and a {{staleness}} S")

    # --- the server update ---------------------------------------------------------------------------------------
    def steps(self, ctx):
        buffer = self.buffer_size(ctx.num_replicas)

        def own(versions, version, model_state, batch, key, participation, staleness, comm_state):
            read = jax.tree.map(lambda buf: buf[(version - staleness[0]) % buffer], versions)
            return rep.replica_step(ctx, read, model_state, batch, key, weight=participation[0],
                                    comm_state=comm_state)

        same = rep.SAME
        sharded = rep.per_replica(ctx, own, in_specs=(same, same, same, rep.BATCH, same, rep.SHARDED, rep.SHARDED,
                                                      same), out_specs=(same, same, same, same))

        def step(state, batch, inputs):
            versions, version = state.strategy_state["versions"], state.strategy_state["version"]
            grads, model_state, metrics, comm_state = sharded(
                versions, version, state.model_state, batch, step_key(state), inputs["participation"],
                inputs["staleness"], state.comm_state)
            new = guarded_update(ctx, state, grads, model_state, metrics)
            # a skipped update is no new version: the slot keeps what it held and the version stays
            slot = (version + 1) % buffer
            written = keep_unless(ctx, new.ok, new.params, jax.tree.map(lambda buf: buf[slot], versions))
            versions = jax.tree.map(lambda buf, p: buf.at[slot].set(p), versions, written)
            version = keep_unless(ctx, new.ok, version + 1, version)
            return state._replace(step=state.step + 1, params=new.params, model_state=new.model_state,
                                  opt_state=new.opt_state, strategy_state={"versions": versions, "version": version},
                                  comm_state=keep_unless(ctx, new.ok, comm_state, state.comm_state)), new.metrics

        return {self.UPDATE: Variant(step, guards_itself=True)}  # `guarded_update`: checked before it is applied


class ASP(SSP):
    name = "asp"
    bounded = False

    def __init__(self, *, stragglers=None, allreduce: str | None = None, torus_x: int | None = None,
                 horizon: int = 10_000, max_buffer_bytes: int | None = None):
        super().__init__(None, stragglers=stragglers, allreduce=allreduce, torus_x=torus_x, horizon=horizon,
                         max_buffer_bytes=max_buffer_bytes)
