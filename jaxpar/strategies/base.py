"""The contract between the trainer and a strategy (`Strategy`, what a step is built from and returns), and
`StrategyBase`, what the built-in strategies share (their communicator and straggler profile, checked against the
mesh).

A strategy decides how data replicas agree on parameters; the Trainer needs only the core the `Strategy` protocol
lists. What other parts of jaxpar know of a strategy lives with them, keyed by strategy class: e.g. its prices in
`jaxpar.cost.strategy_costs`, its restore notes in `jaxpar.io.checkpoint.strategy_notes`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import optax
from jax.sharding import Mesh

from jaxpar.checks import check_int
from jaxpar.errors import ConfigError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.collectives import Communicator
from jaxpar.parallel.collectives import communicator as make_communicator
from jaxpar.parallel.compression import compressed, parse_codec
from jaxpar.strategies.stragglers import Stragglers, as_stragglers
from jaxpar.train.step import LossFn, TrainState

# BatchNorm statistics: over the global batch, or each replica's slice (`StrategyBase.local_statistics` decides
# which a strategy's steps can give; the CLI's --bn values)
BN_SYNC, BN_LOCAL = "sync", "local"


class StepContext(NamedTuple):
    """What a strategy may use to build its step: all static, all decided by the trainer."""

    graphdef: Any  # the model's structure in train mode
    abstract_params: Any  # ShapeDtypeStructs of the params pytree
    loss_fn: LossFn  # in the three-argument form (model, batch, rngs)
    tx: optax.GradientTransformation
    mesh: Mesh
    param_shardings: Any  # NamedShardings of the params pytree
    model_state_shardings: Any  # NamedShardings of the non-parameter model state
    opt_shardings: Any  # NamedShardings of the optimizer state
    grad_accum: int = 1  # microbatches per update (gradient accumulation)
    communicator: Communicator | None = None  # the strategy's averaging algorithm (None: the compiler's)
    skip_nonfinite: bool = True  # a step that checks itself (`guards_itself`): skip (True) or flag a non-finite one

    @property
    def num_replicas(self) -> int:
        return mesh_lib.replica_count(self.mesh)


class Variant(NamedTuple):
    """One step variant of a strategy and what the trainer must know about it."""

    step: "StepFn"  # pure: (state, batch, inputs) -> (state, metrics)
    guards_itself: bool = False  # it checks its update for non-finite values itself (skip or flag; `faults`)
    per_replica_metrics: bool = False  # its metrics are [R] arrays, one value per replica, left where they are


class Plan(NamedTuple):
    variant: str  # key into `steps(ctx)`
    inputs: dict = {}  # small arrays passed to the step as its third argument
    host_metrics: dict = {}  # floats reported with the step's metrics
    work_fraction: float = 1.0  # share of the global batch whose gradient is applied (SSP / ASP: participants)


StepFn = Callable[[TrainState, dict, dict], "tuple[TrainState, dict]"]


class Strategy(Protocol):
    """How data replicas agree on parameters: a small object of pure functions, in the spirit of optax's
    `GradientTransformation`. The Trainer needs only this core:

    - `name`: what checkpoints and messages call it;
    - `init(ctx, state) -> state`: rearranges a fresh, strategy-free `TrainState` (inside the jitted
      initialisation), e.g. adds per-replica parameters to `strategy_state` (always a dict of named parts);
    - `reduce(state) -> state` (a classmethod: it needs no instance): the inverse, back to the strategy-free state,
      for a restore onto another mesh, replica count or strategy. It works on any tree with the same nesting: a
      real `TrainState`, or a checkpoint's arrays nested by name;
    - `shardings(ctx, shardings) -> shardings`: the `NamedSharding`s of what `init` returns;
    - `steps(ctx) -> {variant name: Variant}`: pure step functions `step(state, batch, inputs) -> (state, metrics)`
      with what the trainer must know about each; several variants exist when communication differs between steps
      (local SGD's local step has no collective at all, its meeting does);
    - `plan(ctx, step_number) -> Plan`: which variant runs for the update with that (0-based) number, the small
      per-step arrays it needs and host-side metrics.

    Two attributes are read when present: `communicator` (its averaging algorithm, a `jaxpar.Communicator`; absent
    or None: the compiler's) and `clock` (a `jaxpar.strategies.clock.Clock` behind the `sim_time` metric; absent
    or None: no `sim_time`). A strategy keeps no hidden state: `plan` is a pure function of (replica count, step
    number) and its configuration, and everything on device lives in `TrainState`, so it is jitted, donated and
    checkpointed as one.

    A strategy of your own, per-step synchronous SGD written by hand (what `jaxpar.Sync()` does)::

        from jaxpar.strategies import Plan, Variant
        from jaxpar.train.step import apply_gradients, loss_and_grad, step_key

        class PerStepSync:
            name = "per_step_sync"

            def init(self, ctx, state):
                return state

            @classmethod
            def reduce(cls, state):
                return state

            def shardings(self, ctx, shardings):
                return shardings

            def steps(self, ctx):
                def step(state, batch, inputs):
                    loss, metrics, model_state, grads = loss_and_grad(
                        ctx.graphdef, ctx.loss_fn, state.params, state.model_state, batch, step_key(state),
                        ctx.grad_accum)
                    params, opt_state = apply_gradients(ctx.tx, state.params, state.opt_state, grads)
                    return state._replace(step=state.step + 1, params=params, opt_state=opt_state,
                                          model_state=model_state), {"loss": loss, **metrics}
                return {"step": Variant(step)}

            def plan(self, ctx, step_number):
                return Plan("step")

    `jaxpar.Trainer(..., strategy=PerStepSync())` trains with it (the trainer checks every update for non-finite
    values around a variant that does not guard itself); `jaxpar.explain` prices it as
    `jaxpar.cost.strategy_costs` says of a strategy it does not know.
    """

    name: str

    def init(self, ctx: StepContext, state: TrainState) -> TrainState: ...

    @classmethod
    def reduce(cls, state: TrainState) -> TrainState: ...

    def shardings(self, ctx: StepContext, shardings: TrainState) -> TrainState: ...

    def steps(self, ctx: StepContext) -> dict[str, Variant]: ...

    def plan(self, ctx: StepContext, step_number: int) -> Plan: ...


class StrategyBase:
    """What the built-in strategies share: `communicator` (None = the compiler's all-reduce), a codec around it
    (`compress`), and `stragglers` (the profile their clock runs on); checked against the mesh."""

    local_statistics = True  # replicas compute on their own slice, so BatchNorm statistics are per replica
    DEFAULT_ALLREDUCE: str | None = "psum"  # the averaging when none is given (None: the compiler's, one jit step)

    def __init__(self, allreduce, torus_x, stragglers):
        cls = type(self).__name__
        allreduce = self.DEFAULT_ALLREDUCE if allreduce is None else allreduce
        if allreduce is not None and not isinstance(allreduce, (str, Communicator)):
            raise ConfigError(f"{cls}(allreduce={allreduce!r}): must be None or one of 'psum', 'ring', 'torus2d', "
                              f"'ps' (or a jaxpar.Communicator)")
        check_int(f"{cls}(torus_x=...)", torus_x, 1, "X of the X x Y torus2d grid", optional=True)
        if stragglers is not None and not isinstance(stragglers, (str, Stragglers)):
            raise ConfigError(f"{cls}(stragglers={stragglers!r}): must be None or a profile string like '3:2.0' "
                              f"(replica 3 is 2x slower)")
        if torus_x is not None and allreduce is None:
            make_communicator("psum", torus_x)  # raises: a torus X applies only to torus2d
        self.communicator = None if allreduce is None else make_communicator(allreduce, torus_x)
        self.stragglers = as_stragglers(stragglers)
        self.notes: list[str] = []  # what the trainer logs at start (`Trainer.notes`)

    @property
    def allreduce(self) -> str | None:
        return None if self.communicator is None else self.communicator.name

    @property
    def torus_x(self) -> int | None:
        return None if self.communicator is None else self.communicator.torus_x

    def _compress(self, compress) -> None:
        """Wraps this strategy's exchange over the replica axis in the codec `compress` names (None / 'none':
        unchanged; a codec object is taken as it is). A codec wraps a hand-written exchange; the compiler's
        averaging (`Sync()`'s default, no communicator) has none to wrap, so a codec without an allreduce takes the
        hand-written psum, with a note."""
        codec = parse_codec(compress) if compress is None or isinstance(compress, str) else compress
        if codec is None:
            return
        if self.communicator is None:
            self.communicator = make_communicator("psum")
            self.notes.append(f"compress {codec.name} without an allreduce: the gradient is averaged by the "
                              f"hand-written psum (allreduce psum), since the compiler's averaging cannot be "
                              f"compressed; each replica draws its own dropout masks and BatchNorm statistics")
        self.communicator = compressed(self.communicator, codec)

    def check_against_mesh(self, ctx) -> None:
        """The checks that need the replica count, run when the trainer is built (before anything compiles)."""
        self.stragglers.check(ctx.num_replicas)
        if self.local_statistics and mesh_lib.own_names(ctx.mesh):
            raise ConfigError(f"strategy {self.name!r} (allreduce {self.allreduce or 'psum'!r}): its replicas run "
                              f"in a shard_map over the replica axis, which jaxpar does not build yet on a mesh with "
                              f"the model's own axis names or Explicit axes ({mesh_lib.shape_line(ctx.mesh)}); use "
                              f"jaxpar.Sync() (the compiler's averaging) on this mesh")
        if self.communicator is not None:
            self.communicator.check(ctx.num_replicas)
