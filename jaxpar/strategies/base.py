"""The contract between the trainer and a strategy.

A strategy is a small object of pure functions, in the spirit of optax's `GradientTransformation`:

- `init(ctx, state) -> state`: rearranges a fresh `TrainState` (inside the jitted initialisation), e.g. adds
  per-replica parameters to `strategy_state`;
- `shardings(ctx, shardings) -> shardings`: the `NamedSharding`s of what `init` returns;
- `steps(ctx) -> {variant: step}`: pure functions `step(state, batch, inputs) -> (state, metrics)`; the trainer
  jits each once and adds the non-finite check, unless the step has `guards_itself = True` (local SGD's local step
  checks each replica on its own, so that nothing crosses the replica axis); metrics are scalars, or one value
  per replica (`[R]` arrays, averaged on the host) from a step that sends nothing between replicas. Several variants exist when communication differs between steps (local SGD's local step has
  no collective at all; its averaging step does);
- `plan(ctx, step_number) -> Plan`: which variant runs for the update with that (0-based) number, the small per-step
  arrays it needs (participation flags, staleness indices) and host-side metrics (simulated time).

Strategies keep no hidden state: `plan` is a pure function of (replica count, step number) and the strategy's
configuration (memoised per replica count), and everything on device lives in `TrainState`, so it is jitted,
donated and checkpointed as one.

Each strategy also declares its facts as class attributes: `OPTIONS` (its config fields and their defaults) and
`local_statistics` (replicas compute on their own slice, so BatchNorm statistics are per replica).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import optax
from jax.sharding import Mesh

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.collectives import Communicator
from jaxpar.train.step import LossFn, TrainState


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


class Plan(NamedTuple):
    variant: str  # key into `steps(ctx)`
    inputs: dict = {}  # small arrays passed to the step as its third argument
    host_metrics: dict = {}  # floats reported with the step's metrics
    work_fraction: float = 1.0  # share of the global batch whose gradient is applied (SSP / ASP: participants)


StepFn = Callable[[TrainState, dict, dict], "tuple[TrainState, dict]"]


class Strategy(Protocol):
    name: str

    def init(self, ctx: StepContext, state: TrainState) -> TrainState: ...

    def shardings(self, ctx: StepContext, shardings: TrainState) -> TrainState: ...

    def steps(self, ctx: StepContext) -> dict[str, StepFn]: ...

    def plan(self, ctx: StepContext, step_number: int) -> Plan: ...
