"""The contract between the trainer and a strategy: a small object of pure functions, in the spirit of optax.

A strategy decides how data replicas agree on parameters. It owns every fact about itself; no module outside
`jaxpar.strategies` names a strategy or a step variant, they ask the strategy:

- `init(ctx, state) -> state`: rearranges a fresh, strategy-free `TrainState` (inside the jitted initialisation),
  e.g. adds per-replica parameters to `strategy_state` (always a dict of named parts);
- `reduce(state) -> state` (a classmethod: it needs no instance): the inverse, back to the strategy-free state, for
  a restore onto another mesh, replica count or strategy (per-replica copies averaged as at a meeting, stale
  versions dropped). It works on any tree with the same nesting: a real `TrainState`, or a checkpoint's arrays
  nested by name. `kept_on_restore` names the `TrainState` fields of the strategy's own that carry over when the
  same strategy restores onto another replica count (DiLoCo's outer optimizer state); `REDUCE_NOTE` says what
  `reduce` did, for the restore's note;
- `shardings(ctx, shardings) -> shardings`: the `NamedSharding`s of what `init` returns;
- `steps(ctx) -> {variant name: Variant}`: pure step functions `step(state, batch, inputs) -> (state, metrics)`
  with what the trainer must know about each (`Variant`); several variants exist when communication differs
  between steps (local SGD's local step has no collective at all, its meeting does);
- `variant_shares() -> {variant: share of a long run's steps}` (None: a fixed number of steps at the start);
- `plan(ctx, step_number) -> Plan`: which variant runs for the update with that (0-based) number, the small per-step
  arrays it needs (participation flags, staleness indices) and host-side metrics;
- `theory(ctx, variant, gradient_bytes) -> [Expected]`: the data-axis exchanges the variant should contain, for
  `explain`'s theory lines;
- `project(exchange_seconds, local_seconds, period) -> (seconds, how)` (a classmethod): its mean step time
  projected from another run's exchanging and local step times (for `explain`'s comparison of strategies);
  `period`: the steps between exchanges over the replica axis (1 for every strategy but local SGD / DiLoCo);
- `clock`: its simulated clock (`sim_time`), priced by the trainer when a hardware profile is given.

Strategies keep no hidden state: `plan` is a pure function of (replica count, step number) and the strategy's
configuration (memoised per replica count), and everything on device lives in `TrainState`, so it is jitted,
donated and checkpointed as one.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import optax
from jax.sharding import Mesh

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.collectives import Communicator
from jaxpar.train.step import LossFn, TrainState


# BatchNorm statistics: over the global batch, or each replica's slice (`Strategy.local_statistics` decides which a
# strategy's steps can give; the CLI's --bn values)
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


class Expected(NamedTuple):
    """An exchange over the replica axis that theory says a step variant contains (for `explain`)."""

    what: str  # e.g. "gradient average"
    kind: str  # "all-reduce" (psum / ring / torus2d: 2(N-1)/N x bytes per device) or "ps" ((N-1) x bytes at the root)
    bytes: int  # the payload per replica
    share: float = 1.0  # how often per step (a meeting every H steps: 1/H)


class Plan(NamedTuple):
    variant: str  # key into `steps(ctx)`
    inputs: dict = {}  # small arrays passed to the step as its third argument
    host_metrics: dict = {}  # floats reported with the step's metrics
    work_fraction: float = 1.0  # share of the global batch whose gradient is applied (SSP / ASP: participants)


StepFn = Callable[[TrainState, dict, dict], "tuple[TrainState, dict]"]


class Strategy(Protocol):
    name: str
    local_statistics: bool  # replicas compute on their own slice, so BatchNorm statistics are per replica
    kept_on_restore: tuple  # TrainState fields of its own that a restore onto another replica count keeps
    REDUCE_NOTE: str  # what `reduce` does, for a restore's note ("{replicas}": the saved replica count)
    communicator: Communicator | None
    clock: Any
    period: int  # steps between exchanges over the replica axis

    def init(self, ctx: StepContext, state: TrainState) -> TrainState: ...

    @classmethod
    def reduce(cls, state: TrainState) -> TrainState: ...

    def shardings(self, ctx: StepContext, shardings: TrainState) -> TrainState: ...

    def steps(self, ctx: StepContext) -> dict[str, Variant]: ...

    def variant_shares(self) -> dict[str, float | None]: ...

    def plan(self, ctx: StepContext, step_number: int) -> Plan: ...

    def theory(self, ctx: StepContext, variant: str, gradient_bytes: int) -> list[Expected]: ...

    @classmethod
    def project(cls, exchange: float, local: float, period: int) -> tuple[float, str]: ...
