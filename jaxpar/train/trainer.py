"""Trainer: init / step / evaluate / fit for any Flax NNX model on a (data, stage, fsdp, model) mesh.

    import jaxpar, optax
    trainer = jaxpar.Trainer(model=lambda rngs: MyModel(rngs=rngs), loss_fn=my_loss,
                             optimizer=optax.adamw(1e-3), mesh=jaxpar.make_mesh("data=2,fsdp=2,model=2"))
    state = trainer.init(seed=0)
    state, metrics = trainer.step(state, {"x": x_np, "y": y_np})
    state = trainer.fit(state, batches, steps=1000, actions=[...])
    params = trainer.params(state)

Parameters and optimizer state are created already sharded: the model is built abstractly (`nnx.eval_shape`), its
logical axis names are mapped to `NamedSharding`s, and the real values are created inside
`jax.jit(init, out_shardings=...)`, so no device ever holds a whole sharded parameter.

Beside it: argument checks and the state's layout (`setup.py`), the jitted steps (`compiled.py`), batches
(`batches.py`, `batch_cache.py`), the fit loop (`loop.py`), and the pricer that `hardware` brings (`pricer.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxpar.errors import ModelCallError
from jaxpar.parallel import context
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd
from jaxpar.pipeline.config import Pipeline
from jaxpar.runtime.compile_cache import ensure_compile_cache
from jaxpar.runtime.distributed import to_host
from jaxpar.runtime.resources import device_error
from jaxpar.strategies import Strategy, Sync
from jaxpar.train import loop
from jaxpar.train.actions import Action
from jaxpar.train.axes import bind_loss, check_axis_names
from jaxpar.train.batch_cache import KnownBatches
from jaxpar.train.batches import BatchPlacer
from jaxpar.train.compiled import OWN, StepCompiler
from jaxpar.train.linen import factory_notes
from jaxpar.train.model_errors import at_step
from jaxpar.train.pricer import pricer_for
from jaxpar.train.remat import policy_of
from jaxpar.train.replica_metrics import ReplicaMeans
from jaxpar.train.setup import check_arguments, check_pipeline, state_layout
from jaxpar.train.state_maker import StateMaker
from jaxpar.train.step import LossFn, TrainState, check_state, evaluate_batch, step_key, with_rngs

log = logging.getLogger("jaxpar")


class Trainer:
    """Trains `model` (a factory `rngs -> nnx.Module`) with `loss_fn` and `optimizer` on `mesh`.

    Args:
      model: a function `rngs -> nnx.Module` (e.g. the class itself, or `jaxpar.from_linen(...)`).
      loss_fn: `(model, batch) -> (loss, metrics)` or `(model, batch, rngs) -> (loss, metrics)`; in the second
        form `rngs` is an `nnx.Rngs` with a fresh `dropout` stream every step (see `jaxpar.train.step`).
      optimizer: an optax GradientTransformation (e.g. `optax.adamw(1e-3)`, not the string "adamw").
      mesh: from `jaxpar.make_mesh` (a `Mesh` with Auto axes data, stage, fsdp, model).
      rules: logical axis name -> mesh axis, a dict or Flax's list of pairs (None: `DEFAULT_RULES`).
      strict: False (default): FSDP placement never fails: a dimension mapped to fsdp that does not divide moves to
        the largest one that does (or the parameter stays whole), and a parameter with no logical names is split
        over fsdp along its largest dimension that divides (each reported in `notes`). True: such a dimension is a
        `ShardingError` and unnamed parameters stay whole. A model or stage dimension that does not divide is an
        error either way.
      path_rules: `[(regex over the parameter path, one entry per dimension), ...]`, as t5x / MaxText write them,
        e.g. `[(r".*attention.*kernel", (None, "model"))]`: the first regex found in a parameter's `/`-joined path
        replaces its own names; an entry that is a mesh axis is used as it is, any other is a logical name mapped
        by `rules` (`jaxpar.parallel.path_rules`).
      strategy: how replicas agree (default `Sync()`).
      grad_accum: microbatches per update (must divide the per-replica batch).
      eval_loss_fn: the loss for `evaluate` (default `loss_fn`), e.g. without label smoothing.
      pipeline: how a model's `jaxpar.pipeline.Stack` runs over the mesh's stage axis (`jaxpar.pipeline.Pipeline`:
        schedule "gpipe", "circular" or "1f1b", microbatches, repeats); default GPipe with one microbatch.
      skip_nonfinite: a step whose loss, gradients or new model state are not finite leaves the state
        bit-identical (the step counter still advances; the optimizer does not run) and reports `skipped` = 1.0 in
        its metrics; False applies it and reports `nonfinite` = 1.0 when its loss or update is not finite
        (`actions.StopIfDiverged` then stops before that state is checkpointed). See `jaxpar.train.faults`.
      batch_axis_names: axis names the model's own collectives use, as written for pmap (`lax.pmean(x, 'batch')`,
        Linen's `BatchNorm(axis_name='batch')`), e.g. `('batch',)`: they reduce over the whole global batch under
        `Sync()` and over each replica's slice under the explicit strategies (`jaxpar.train.axes`).
      hardware: a hardware profile (`jaxpar.PROFILES[...]`, `jaxpar.parse_hardware(spec)` or the spec itself) that
        prices `sim_time` from the compiled steps (`jaxpar.train.pricer`; jaxpar.cost's `StepPricer`).
      remat: rematerialization, what the backward recomputes instead of keeping: "none" (default, or None),
        "full", "dots", "dots-no-batch", or a `jax.checkpoint_policies` callable (`jaxpar.train.remat`). Per layer
        in a `jaxpar.pipeline.Stack` (the built-in transformer's blocks); for a model without one, the whole forward.
      context_parallel: on a seq > 1 mesh, `jaxpar.attention`'s algorithm: "allgather" (default), "ring", "ulysses"
        or a `jaxpar.parallel.context.ContextParallel` (e.g. the ring without zig-zag).

    A bad argument raises a `jaxpar.JaxparError` subclass naming it (a model factory that raises: `ModelError`); a
    `loss_fn` that returns anything but
    `(scalar loss, dict of scalar metrics)` raises `ModelError` when the step is first traced; an exception raised
    inside the model or loss while a step or evaluation is traced comes out as `ModelError` (`ModelCallError`,
    `FitError` in `fit`) naming the step and the batch's shapes, with the original as `__cause__`. Batches: a dict of
    arrays with a common leading example dimension; numpy / jax arrays, or nested lists of numbers (converted with
    `np.asarray`). Integer labels are not range-checked inside the step (that would need a device-to-host sync);
    check them on the host, e.g. with `models.losses.check_labels`. `step` donates its state (use the state it
    returns; an old one raises `StateError`). Each new batch shape compiles the step again: logged once per shape
    (not for the first compilation) to the `jaxpar` logger at WARNING.
    """

    def __init__(self, model: Callable[[nnx.Rngs], nnx.Module], loss_fn: LossFn,
                 optimizer: optax.GradientTransformation, mesh: Mesh, rules=None, strategy: Strategy | None = None,
                 grad_accum: int = 1, eval_loss_fn: LossFn | None = None, skip_nonfinite: bool = True,
                 hardware=None, pipeline: Pipeline | None = None, batch_axis_names=(), strict: bool = False,
                 path_rules=None, remat=None, context_parallel=None):
        ensure_compile_cache()  # before the first compilation (`jaxpar.use_compile_cache` chooses another folder)
        self.remat = policy_of(remat)
        check_arguments(model, loss_fn, eval_loss_fn, optimizer, mesh, strategy, grad_accum, skip_nonfinite)
        self.pipeline = check_pipeline(pipeline)
        self.context_parallel = context.settings_for(context_parallel, mesh)  # what jaxpar.attention runs on seq
        self.pricer = pricer_for(hardware)  # prices sim_time on a hardware profile (`jaxpar.train.pricer`), or None
        strategy = strategy or Sync()
        self.strategy = strategy if self.pricer is None else self.pricer.strategy_for(strategy, mesh)
        self._keep(model, optimizer, mesh, rules, grad_accum, skip_nonfinite, batch_axis_names, strict, path_rules)
        self._lay_out_state(loss_fn, eval_loss_fn)
        for line in self.notes:
            log.warning(line)
        self._build_steps()
        # the strategy's simulated clock (sim_time), priced by the compiled steps when a profile is given
        clock = getattr(self.strategy, "clock", None)  # a strategy without one reports no sim_time
        self.clock = None if clock is None else clock.priced(None if self.pricer is None else self.pricer.cost)

    def _keep(self, model, optimizer, mesh, rules, grad_accum, skip_nonfinite, batch_axis_names, strict, path_rules):
        self._factory, self._tx = model, optimizer
        self.mesh, self.skip_nonfinite, self.grad_accum = mesh, skip_nonfinite, grad_accum
        self.num_replicas = mesh_lib.replica_count(mesh)  # asked every step (the clock): a mesh never changes
        self.batch_divisor = mesh_lib.batch_ways(mesh)  # a global batch divides by this: data x fsdp
        self.strict, self.path_rules, self.rules = strict, path_rules, (shd.DEFAULT_RULES if rules is None else rules)
        self.batch_axis_names = check_axis_names(batch_axis_names, mesh.axis_names)

    def _lay_out_state(self, loss_fn, eval_loss_fn) -> None:
        """The model traced abstractly, its stacks bound to the pipeline and remat policy, the state placed."""
        bound_loss = bind_loss(with_rngs(loss_fn), self.batch_axis_names)  # the model's own axis names bound
        self.layout = layout = state_layout(
            self._factory, bound_loss, self._tx, self.mesh, self.rules, self.strict, self.strategy, self.grad_accum,
            self.skip_nonfinite, self.path_rules, self.pipeline, self.remat)
        self.ctx, self.sharding_notes, self._eval_graphdef = layout.ctx, layout.notes, layout.eval_graphdef
        self._eval_loss_fn = bind_loss(with_rngs(eval_loss_fn or loss_fn), self.batch_axis_names)
        self.neutral_shardings, self.state_shardings = layout.neutral_shardings, layout.state_shardings
        self.batches = BatchPlacer(self.mesh)
        self.batch_sharding = self.batches.sharding
        self._known_batches = KnownBatches(self.batches, self.num_replicas, self.grad_accum)
        self._last_step = (None, 0)  # (the step array of the state `dispatch` last returned, its step number)
        self._states = StateMaker(self._factory, self._tx, self.ctx, self.strategy, self.mesh,
                                  self.neutral_shardings, self.state_shardings)

    def _build_steps(self) -> None:
        """The strategy's step variants and evaluation, jitted; the pricer told of their compilations."""
        self.variants = self.strategy.steps(self.ctx)
        self._compiler = StepCompiler(self)
        self._steps, self.trace_counts = self._compiler.steps, self._compiler.trace_counts
        self.step_flops = self._compiler.flops  # (variant, batch signature) -> FLOPs of one step on all devices
        self._replica_means = ReplicaMeans(self.mesh)  # `step`'s means of per-replica metrics, on the device
        if self.pricer is not None:
            self.pricer.attach(self)
            self._compiler.watchers.append(self.pricer.compiled)

    def expand(self, neutral: TrainState) -> TrainState:
        """The train state of this trainer's strategy built from a strategy-free one (`strategy.init`, jitted and
        placed by `state_shardings`): what a restore onto another strategy or replica count starts from."""
        return self._states.expand(neutral)

    def abstract_state(self, neutral: bool = False) -> TrainState:
        """The train state's shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s), without computing it;
        `neutral`: the state before the strategy adds its own (placed like the parameters)."""
        return self._states.abstract(neutral)

    def evaluate_step(self, state, batch):
        """The pure evaluation `evaluate` jits: `eval_loss_fn`'s metrics with the model in eval mode."""
        return evaluate_batch(self._eval_graphdef, self._eval_loss_fn, state.params, state.model_state, batch,
                              step_key(state))

    @property
    def notes(self) -> list[str]:
        """What the sharding plan decided that you should know (replicated names, parameters FSDP left whole), and
        what `from_linen` inferred (train_kwargs / eval_kwargs), and the strategy's own (e.g. the psum a codec
        without an allreduce takes)."""
        return (self.sharding_notes.lines(self.mesh) + factory_notes(self._factory) +
                list(getattr(self.strategy, "notes", ())))

    @property
    def trace_count(self) -> int:
        return sum(self.trace_counts.values())

    def init(self, seed: int = 0) -> TrainState:
        """A fresh train state; the same seed (an integer in [0, 2**32)) gives the same parameters on every mesh."""
        return self._states.init(seed)

    def state_bytes_per_device(self) -> int:
        """Bytes the train state takes on the fullest device (parameters, optimizer and strategy state)."""
        return self._states.bytes_per_device()

    def local_rows(self, global_size: int) -> np.ndarray:  # this process's rows of a global batch (`BatchPlacer`)
        return self.batches.local_rows(global_size)

    def global_rows(self, local_size: int) -> int:  # the global batch size of which `local_size` rows are ours
        return self.batches.global_rows(local_size)

    def shard_batch(self, batch: Mapping[str, np.ndarray | jax.Array]) -> dict[str, jax.Array]:
        """Places a global batch on the mesh, examples split over the batch axes (a no-op for placed arrays)."""
        return self.batches.place(self.batches.check(batch)[0])

    check_state = staticmethod(check_state)  # a live TrainState, or a StateError naming the fix

    def step(self, state: TrainState, batch, step_number: int | None = None) -> tuple[TrainState, dict]:
        """One update; `state` is donated (do not reuse it).

        Metrics have the same keys and shapes under every strategy: `loss` and the loss function's metrics as
        scalars (0-d arrays). A step whose replicas sent each other nothing (local SGD / DiLoCo's local and
        meeting steps, in one process) keeps one value per replica on the devices; `step` then returns their mean,
        computed on the device without reading anything back (`jaxpar.train.replica_metrics`; the numbers `fit`
        reports), and each per-replica array under `<name>_per_replica` ([R]). Metrics stay on device until read.

        `step_number` (the number of updates already applied) lets the strategy plan the step without reading
        `state.step` back from the device; `fit` passes it. Host metrics added: the strategy's (e.g. `sim_time`),
        `examples`, the number of examples whose gradient this update applied, `compiled` (1.0) when this call
        compiled the step, and `flops`, the compiled step's FLOPs on all devices by XLA's cost analysis (where the
        backend gives one).
        """
        state, metrics, per_replica = self.dispatch(state, batch, step_number)
        return state, (self._replica_means(metrics) if per_replica else metrics)

    def dispatch(self, state: TrainState, batch, step_number: int | None = None) -> tuple[TrainState, dict, bool]:
        """`step` without reading anything back: (state, metrics as the step left them, whether they are per
        replica). `fit` uses it to keep the device busy while it reads the previous step's metrics. Host work per
        call is a few dictionary lookups: a batch's check and signature are known per structure
        (`jaxpar.train.batch_cache`), and the step number of a state this trainer returned is remembered on the
        host, so `state.step` is never read back (that read would wait for the previous step)."""
        self.check_state(state)
        if step_number is None:
            known_step, known_number = self._last_step
            step_number = known_number if state.step is known_step else int(jax.device_get(state.step))
        plan = self.strategy.plan(self.ctx, step_number)
        placed, rows, shapes = self._known_batches.prepare(batch)
        signature = (plan.variant, shapes)
        compiles = not self._compiler.is_compiled(signature)
        try:  # the first call of a variant on a batch shape traces the model and the loss
            self._compiler.check_memory(signature, plan, state, placed, rows, step_number)
            try:
                state, metrics = self._steps[plan.variant](state, placed, plan.inputs)
            except jax.errors.JaxRuntimeError as error:  # e.g. the compiler or the device refused an allocation
                raise device_error(error, step_number) from None
        except ModelCallError as error:
            raise at_step(error, step_number, placed) from error.__cause__
        self._last_step = (state.step, step_number + 1)
        host = {**plan.host_metrics, "examples": float(rows * plan.work_fraction)}
        if self.clock is not None:
            host["sim_time"] = self.clock.time_after(self.num_replicas, step_number)
        flops = self.step_flops.get(signature)
        if flops is not None:
            host["flops"] = flops
        if compiles:  # this call compiled (the first step, a new batch shape, a new variant)
            host["compiled"] = 1.0
        return state, {**metrics, **host}, self.variants[plan.variant].per_replica_metrics

    def compiled_step(self, variant: str, batch=None, inputs=None, remat=OWN):
        """The compiled step `variant` for a global `batch` (arrays or `jax.ShapeDtypeStruct`s; default: the latest
        batch's shapes) with the strategy's `inputs` (default: none, as every variant but a server update has),
        compiled ahead of time from the train state's shapes: nothing runs, nothing is allocated. `remat`: compile
        it under another rematerialization policy (a name or callable, as `Trainer(remat=...)`) instead of the
        trainer's own; such a program is only inspected (`jaxpar.explain`'s advice), never run."""
        return self._compiler.compiled(variant, batch, inputs, remat)

    def lowered_step(self, variant: str, batch, inputs=None):
        """The step `variant` lowered for a global `batch` (shapes are enough), not compiled: `compiled_step`'s
        first half, so that a caller can compile several programs at once (`jaxpar.plan`)."""
        return self._compiler.lowered(variant, batch, inputs)

    def evaluate(self, state: TrainState, batch) -> dict[str, jax.Array]:
        """`loss_fn`'s metrics in eval mode (no dropout, BatchNorm running averages) on one global batch."""
        self.check_state(state)
        placed = self.shard_batch(batch)
        try:
            return self._compiler.evaluate(state, placed)
        except ModelCallError as error:
            raise at_step(error, int(jax.device_get(state.step)), placed, "evaluate at step") from error.__cause__

    def params(self, state: TrainState) -> dict:
        """The full parameters, gathered from all shards, as a nested dict of numpy arrays."""
        self.check_state(state)
        # with several processes every process takes part: the shards other processes hold are gathered
        return jax.tree.map(np.asarray, nnx.to_pure_dict(to_host(state.params)))

    def fit(self, state: TrainState, batches: Iterable[Mapping], steps: int, actions: Iterable[Action] = (),
            on_step: Callable[[int, dict[str, float]], None] | None = None) -> TrainState:
        """Runs `steps` updates and the `actions` (see `jaxpar.actions`) as their steps' metrics become ready, with at
        most two steps in flight; an action that needs the state runs before the next step is dispatched (that step
        donates the state). See `jaxpar.train.loop`.

        `on_step(step, metrics)` is shorthand for an action called after every step. If the batch iterator runs
        out, a step is refused or an action raises, `fit` raises `FitError` carrying `.state` (the state after
        `.step` updates, never donated) and the cause. `steps` = 0 returns `state` unchanged.
        """
        return loop.fit(self, state, batches, steps, actions, on_step)
