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

Why about 420 lines: the Trainer is the one object users hold, and it keeps together what acts on its jitted step
variants (dispatch, the first compilation's memory check and pricing, ahead-of-time compilation, tracing under an
explicit-sharding mesh, the model's errors said with the step). Its argument
checks and state plan (`setup.py`), batch placement (`batches.py`) and the fit loop (`loop.py`) live apart.
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

from jaxpar.checks import check_int
from jaxpar.cost import codecs, strategy_costs
from jaxpar.cost.hardware import parse_hardware
from jaxpar.cost.topology import aligned
from jaxpar.errors import ConfigError, ModelCallError, ResourceError, StateError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd
from jaxpar.pipeline import scope as pipeline_scope
from jaxpar.pipeline.config import Pipeline
from jaxpar.runtime.compile_cache import ensure_compile_cache
from jaxpar.runtime.distributed import to_host
from jaxpar.runtime.resources import check_fits, check_step_memory, device_error, step_flops
from jaxpar.strategies import Strategy, Sync
from jaxpar.train import loop
from jaxpar.train.actions import Action
from jaxpar.train.axes import bind_loss, check_axis_names
from jaxpar.train.batches import BatchPlacer, indivisible_accum
from jaxpar.train.linen import factory_notes
from jaxpar.train.model_errors import at_step
from jaxpar.train.remat import policy_of
from jaxpar.train.replica_metrics import ReplicaMeans
from jaxpar.train.setup import check_arguments, check_pipeline, state_plan
from jaxpar.train.step import LossFn, TrainState, evaluate_batch, guarded_step, split_model, step_key, with_rngs

_OWN = object()  # `remat` not given: the trainer's own policy

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
      strict: False (default): FSDP placement never fails, whoever wrote the rules: a dimension mapped to fsdp that
        does not divide moves to the largest dimension that does, or the parameter stays whole, and a parameter
        with no logical names is split over fsdp along its largest dimension that divides (each reported in
        `notes`). True: such a dimension is a `ShardingError` and unnamed parameters stay whole. A tensor-parallel
        (model) or stage dimension that does not divide is an error either way.
      path_rules: `[(regex over the parameter path, one entry per dimension), ...]`, as t5x / MaxText write them:
        e.g. `[(r".*Dense_0/kernel", ("embed", "mlp")), (r".*attention.*kernel", (None, "model"))]`. The first
        regex found (`re.search`) in a parameter's `/`-joined path (`hidden/kernel`; a `from_linen` model's Linen
        paths, `Dense_0/kernel`) replaces its own names; an entry that is a mesh axis is used as it is, any other
        name is a logical name mapped by `rules`. See `jaxpar.parallel.path_rules`.
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
        Linen's `BatchNorm(axis_name='batch')`), e.g. `('batch',)`: bound with size 1 around the loss, so they
        reduce over the whole global batch under `Sync()` (sync BatchNorm) and over each replica's slice under the
        explicit strategies (`jaxpar.train.axes`). Unbound, such a model raises `ModelError` naming the axis.
      remat: rematerialization, what the backward recomputes instead of keeping: "none" (default, or None),
        "full", "dots", "dots-no-batch", or a `jax.checkpoint_policies` callable (`jaxpar.train.remat`). Per layer
        in a `jaxpar.pipeline.Stack` (the built-in transformer's blocks); for a model without one, the whole forward.

    A bad argument raises a `jaxpar.JaxparError` subclass naming it; a `loss_fn` that returns anything but
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
                 path_rules=None, remat=None):
        ensure_compile_cache()  # before the first compilation (`jaxpar.use_compile_cache` chooses another folder)
        self.remat = policy_of(remat)
        check_arguments(model, loss_fn, eval_loss_fn, optimizer, mesh, strategy, grad_accum, skip_nonfinite)
        self.pipeline = check_pipeline(pipeline)
        self.hardware = parse_hardware(hardware)
        # a torus2d grid follows the profile's nodes unless its X is given (jaxpar.cost.topology)
        self.mesh, self.skip_nonfinite = mesh, skip_nonfinite
        self._replicas = mesh_lib.replica_count(mesh)  # asked every step (the clock): a mesh never changes
        self.strategy = aligned(strategy or Sync(), mesh, self.hardware)
        self.rules = shd.DEFAULT_RULES if rules is None else rules
        self._factory, self._tx, self.grad_accum = model, optimizer, grad_accum
        self.batch_axis_names = check_axis_names(batch_axis_names, mesh.axis_names)
        bound_loss = bind_loss(with_rngs(loss_fn), self.batch_axis_names)  # the model's own axis names bound
        self.strict, self.path_rules = strict, path_rules
        plan = state_plan(model, bound_loss, optimizer, mesh, self.rules, strict, self.strategy, grad_accum,
                          skip_nonfinite, path_rules)
        self.ctx, self.plan_notes, self._eval_graphdef = plan.ctx, plan.notes, plan.eval_graphdef
        self._eval_loss_fn = bind_loss(with_rngs(eval_loss_fn or loss_fn), self.batch_axis_names)
        self.neutral_shardings, self.state_shardings = plan.neutral_shardings, plan.state_shardings
        self.batches = BatchPlacer(mesh)
        self.batch_sharding = self.batches.sharding
        self.trace_counts: dict[str, int] = {}  # compilations per step variant (one per batch shape it ran on)
        self._memory_checked: set = set()  # (variant, batch signature) whose compiled step fits a device
        self._compiled: set = set()  # (variant, batch signature) compiled so far
        self.step_flops: dict = {}  # (variant, batch signature) -> FLOPs of one step on all devices (cost analysis)
        self.step_costs: dict = {}  # variant -> its StepCost on `hardware` (the latest batch shape it compiled for)
        self._abstract_batch = None  # the latest batch's shapes: what a step variant is priced on before it runs
        self._known_batches: dict = {}  # `_batch_shapes` of a checked batch -> (rows, signature, placed?)
        self._last_step = (None, 0)  # (the step array of the state `dispatch` last returned, its step number)
        self._state_bytes: int | None = None
        for line in self.notes:
            log.warning(line)

        # on an Explicit mesh every trace happens under jax.set_mesh (mesh_lib.tracing), outside jit
        self._init = mesh_lib.in_mesh(jax.jit(self._init_state, out_shardings=self.state_shardings), mesh)
        self.variants = self.strategy.steps(self.ctx)
        # a variant whose metrics are one value per replica ([R]) leaves them where they are: gathering them would
        # be a collective over the replica axis; the host takes their mean when they are read (`loop.host_metrics`)
        self._steps = {name: self._jit_step(variant, self.remat) for name, variant in self.variants.items()}
        self._replica_means = ReplicaMeans(mesh)  # `step`'s means of such metrics, on the device
        self._other_remat: dict = {}  # (variant, policy) -> the step jitted under another remat policy (explain's advice)
        self._eval = mesh_lib.in_mesh(jax.jit(self._scoped(self._eval_step), in_shardings=(
            self.state_shardings, self.batch_sharding), out_shardings=shd.replicated(mesh)), mesh)
        # the strategy's simulated clock (sim_time), priced here by the compiled steps when a profile is given; a
        # strategy without one reports no sim_time
        clock = getattr(self.strategy, "clock", None)
        self.clock = None if clock is None else clock.priced(self.variant_cost if self.hardware else None)

    def _jit_step(self, variant, remat):
        """The jitted step of a strategy `variant` under the remat policy `remat`."""
        return mesh_lib.in_mesh(jax.jit(
            self._scoped(guarded_step(variant, self.state_shardings, self.mesh, self.skip_nonfinite), remat),
            in_shardings=(self.state_shardings, self.batch_sharding, None),
            out_shardings=(self.state_shardings, None if variant.per_replica_metrics else shd.replicated(self.mesh)),
            donate_argnums=0), self.mesh)

    # --- pure functions (jitted above) ---------------------------------------------------------------------------
    def _scoped(self, fn, remat=_OWN):
        """`fn` tracing with this trainer's mesh, pipeline and remat policy (or `remat`) in scope (what a
        `jaxpar.pipeline.Stack` and the loss's forward read)."""
        return pipeline_scope.within(self.mesh, self.pipeline, fn, self.remat if remat is _OWN else remat)

    def _init_state(self, seed) -> TrainState:
        return self._expand(self._neutral_state(seed))

    def _neutral_state(self, seed) -> TrainState:
        """The state before the strategy adds its own: what any strategy's state reduces to (`Strategy.reduce`; a restore goes through it)."""
        with nnx.use_eager_sharding(False):
            model = self._factory(nnx.Rngs(jax.random.key(seed)))
        _, params, model_state = split_model(model)
        comm = self.ctx.communicator
        # the run key: a separate stream from initialisation's (same seed, another fold)
        return TrainState(jnp.zeros((), jnp.int32), params, model_state, self._tx.init(params), (),
                          jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 1)),
                          () if comm is None else comm.init_state(params, self.ctx.num_replicas))

    def _expand(self, neutral: TrainState) -> TrainState:
        return self.strategy.init(self.ctx, neutral)

    def expand(self, neutral: TrainState) -> TrainState:
        """The train state of this trainer's strategy built from a strategy-free one (`strategy.init`, jitted and
        placed by `state_shardings`): what a restore onto another strategy or replica count starts from."""
        return mesh_lib.in_mesh(jax.jit(self._expand, out_shardings=self.state_shardings), self.mesh)(neutral)

    def abstract_state(self, neutral: bool = False) -> TrainState:
        """The train state's shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s), without computing it;
        `neutral`: the state before the strategy adds its own (placed like the parameters)."""
        seed = jnp.asarray(0, jnp.uint32)
        with mesh_lib.tracing(self.mesh):
            return self._abstract_state(seed, neutral)

    def _abstract_state(self, seed, neutral: bool) -> TrainState:
        if neutral:
            shapes = jax.eval_shape(self._neutral_state, seed)
            shardings = self.neutral_shardings
        else:
            shapes, shardings = jax.eval_shape(self._init_state, seed), self.state_shardings
        leaves, treedef = jax.tree.flatten(shapes)
        placed = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
        return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                            for x, s in zip(leaves, placed, strict=True)])

    def _eval_step(self, state, batch):
        return evaluate_batch(self._eval_graphdef, self._eval_loss_fn, state.params, state.model_state, batch,
                              step_key(state))

    # --- public API ----------------------------------------------------------------------------------------------
    @property
    def notes(self) -> list[str]:
        """What the sharding plan decided that you should know (replicated names, parameters FSDP left whole), and
        what `from_linen` inferred (train_kwargs / eval_kwargs)."""
        return self.plan_notes.lines(self.mesh) + factory_notes(self._factory)

    @property
    def trace_count(self) -> int:
        return sum(self.trace_counts.values())

    @property
    def num_replicas(self) -> int:
        return self._replicas

    @property
    def batch_divisor(self) -> int:
        """A global batch must divide by this: the product of the batch axes (data x fsdp)."""
        return mesh_lib.batch_ways(self.mesh)

    def init(self, seed: int = 0) -> TrainState:
        """A fresh train state; the same seed (an integer in [0, 2**32)) gives the same parameters on every mesh."""
        check_int("seed", seed, 0, high=2**32)
        self._check_memory()
        state = self._init(jnp.asarray(seed, jnp.uint32))
        try:
            # A device error (e.g. out of memory) surfaces here at once; reading `state.step` first would wait
            # forever on XLA:CPU (the failed computation never marks that buffer ready).
            jax.block_until_ready((state.params, state.opt_state, state.strategy_state))
        except jax.errors.JaxRuntimeError as error:
            raise ResourceError(f"creating the train state failed on the device: {str(error).splitlines()[0]}; "
                                f"it needs {self.state_bytes_per_device():,} bytes per device: use a smaller model "
                                f"or split it over more devices (fsdp / model axes)") from None
        return state

    def state_bytes_per_device(self) -> int:
        """Bytes the train state takes on the fullest device (parameters, optimizer and strategy state)."""
        if self._state_bytes is None:
            with mesh_lib.tracing(self.mesh):
                abstract = jax.eval_shape(self._init_state, jnp.asarray(0, jnp.uint32))
            self._state_bytes = shd.bytes_per_device(abstract, self.state_shardings)
        return self._state_bytes

    def _check_memory(self) -> None:
        """Refuses a train state that cannot fit in one device's memory, before anything is allocated."""
        check_fits(self.state_bytes_per_device(), self.mesh, "the train state", "use a smaller model, or split "
                   "parameters and optimizer state over more devices (a larger fsdp or model axis)")

    def local_rows(self, global_size: int) -> np.ndarray:
        """The rows of a global batch of `global_size` rows that this process loads (see `BatchPlacer`)."""
        return self.batches.local_rows(global_size)

    def global_rows(self, local_size: int) -> int:
        """The global batch size of which `local_size` rows are this process's share."""
        return self.batches.global_rows(local_size)

    def shard_batch(self, batch: Mapping[str, np.ndarray | jax.Array]) -> dict[str, jax.Array]:
        """Places a global batch on the mesh, examples split over the batch axes (a no-op for placed arrays)."""
        return self.batches.place(self.batches.check(batch)[0])

    @staticmethod
    def check_state(state) -> None:
        """Refuses anything but a live `TrainState` (a donated one names the fix)."""
        if not isinstance(state, TrainState):
            raise StateError(f"state: got {type(state).__name__}; pass the TrainState from trainer.init or "
                             f"trainer.step")
        # `step` donates the whole state at once, so its step counter tells (a walk of the parameters would cost
        # every step)
        if isinstance(state.step, jax.Array) and state.step.is_deleted():
            raise StateError("state: its arrays were donated to an earlier call; `step` donates its state: use "
                             "the state it returned (state, metrics = trainer.step(state, batch))")

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
        replica). `fit` uses it to keep the device busy while it reads the previous step's metrics.

        Host work per call is a few dictionary lookups (docs/benchmarks.md, host overhead): a batch is checked and
        its signature built once per structure (keys, array types, shapes, dtypes), and the step number of a state
        this trainer returned is remembered on the host, so `state.step` is never read back (that read waited for
        the previous step and cost the overlap of host and device work)."""
        self.check_state(state)
        if step_number is None:
            known_step, known_number = self._last_step
            step_number = known_number if state.step is known_step else int(jax.device_get(state.step))
        plan = self.strategy.plan(self.ctx, step_number)
        shapes = self._batch_shapes(batch)
        known = self._known_batches.get(shapes) if shapes is not None else None
        if known is None:
            checked, rows = self.batches.check(batch)
            problem = indivisible_accum(rows, self.num_replicas, self.grad_accum)
            if problem:
                raise ConfigError(problem)
            placed = self.batches.place(checked)
            shape_key = self._signature("", placed)[1]
            if shapes is not None:  # arrays already on the batch sharding need no placement next time either
                in_place = all(placed[k] is v for k, v in batch.items())
                self._known_batches[shapes] = (rows, shape_key, in_place)
        else:
            rows, shape_key, in_place = known
            placed = batch if in_place else self.batches.place(batch)
        signature = (plan.variant, shape_key)
        compiles = signature not in self._compiled
        try:  # the first call of a variant on a batch shape traces the model and the loss
            if compiles or signature not in self._memory_checked:
                self._check_step_memory(signature, plan, state, placed, rows, step_number)
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

    @staticmethod
    def _batch_shapes(batch):
        """What decides a batch's check, placement and compilation, cheap to build: a tuple of (key, array type,
        shape, dtype, sharding of a placed array); None for anything but a dict of numpy / jax arrays (checked
        every call)."""
        if type(batch) is not dict:
            return None
        shapes = []
        for key, value in batch.items():
            kind = type(value)
            if kind is np.ndarray:
                shapes.append((key, kind, value.shape, value.dtype, None))
            elif isinstance(value, jax.Array):
                shapes.append((key, kind, value.shape, value.dtype, value.sharding))
            else:
                return None
        return tuple(shapes)

    def _count_compilation(self, signature: tuple) -> None:
        """Counted on the host, outside the traced step: each (variant, batch shape) compiles once (jit caches it;
        an ahead-of-time compilation of the same signature is the one a later call uses)."""
        if signature in self._compiled:
            return
        self._compiled.add(signature)
        variant, shapes = signature
        count = self.trace_counts[variant] = self.trace_counts.get(variant, 0) + 1
        if count > 1:  # the first compilation is expected; later ones mean a new batch shape
            shapes = ", ".join(f"{k}: {dtype}{list(shape)}" for k, shape, dtype in shapes)
            log.warning(f"step variant {variant!r} compiles again (compilation {count}) for a new batch shape "
                        f"{{{shapes}}}: each new batch shape compiles the step anew (expected once per size of a "
                        f"deliberate batch-size ramp; otherwise keep batch shapes fixed, e.g. drop or pad the last "
                        f"batch)")

    @staticmethod
    def _signature(variant: str, batch) -> tuple:
        """A step variant on a batch shape: what one compilation serves."""
        return variant, tuple((k, tuple(v.shape), str(v.dtype)) for k, v in batch.items())

    def _check_step_memory(self, signature, plan, state, placed, rows, step_number) -> None:
        """Before a step variant first runs on a batch shape: its compiled per-device bytes must fit a device.
        The compilation is the one the call then uses (jit caches it), so this costs no extra compile."""
        if signature in self._memory_checked:
            return
        self._abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
                                for k, v in placed.items()}
        try:
            compiled = self._steps[plan.variant].lower(state, placed, plan.inputs).compile()
        except jax.errors.JaxRuntimeError as error:
            raise device_error(error, step_number) from None
        self._count_compilation(signature)
        self._price(plan.variant, compiled)
        check_step_memory(compiled, self.mesh, plan.variant, rows, self.batch_divisor, self.state_bytes_per_device())
        flops = step_flops(compiled)
        if flops is not None:
            self.step_flops[signature] = flops * self.mesh.size  # every device runs the same partitioned program
        self._memory_checked.add(signature)

    def _price(self, variant: str, compiled) -> None:
        if self.hardware is not None:
            expected = strategy_costs.theory(self.strategy, variant, 0)
            gradients = any(e.what == "gradients" for e in expected)
            self.step_costs[variant] = codecs.compiled_step_cost(self, compiled, gradients, bool(expected))

    def compiled_step(self, variant: str, batch=None, inputs=None, remat=_OWN):
        """The compiled step `variant` for a global `batch` (arrays or `jax.ShapeDtypeStruct`s; default: the latest
        batch's shapes) with the strategy's `inputs` (default: none, as every variant but a server update has),
        compiled ahead of time from the train state's shapes: nothing runs, nothing is allocated. `remat`: compile
        it under another rematerialization policy (a name or callable, as `Trainer(remat=...)`) instead of the
        trainer's own; such a program is only inspected (`jaxpar.explain`'s advice), never run."""
        if batch is None:
            batch = self._abstract_batch
        if batch is None:
            raise StateError("no batch yet: pass one (its shapes are enough) to compile a step variant for it")
        if variant not in self._steps:
            raise ConfigError(f"step variant {variant!r}: the strategy {self.strategy.name!r} has "
                              f"{', '.join(sorted(self._steps))}")
        abstract = self.batches.abstract(batch)
        if remat is not _OWN:
            policy = policy_of(remat)
            if (variant, policy) not in self._other_remat:
                self._other_remat[variant, policy] = self._jit_step(self.variants[variant], policy)
            return self._other_remat[variant, policy].lower(self.abstract_state(), abstract, inputs or {}).compile()
        compiled = self.lowered_step(variant, batch, inputs).compile()
        self._count_compilation(self._signature(variant, abstract))
        return compiled

    def lowered_step(self, variant: str, batch, inputs=None):
        """The step `variant` lowered for a global `batch` (shapes are enough), not compiled: `compiled_step`'s
        first half, so that a caller can compile several programs at once (`jaxpar.plan`)."""
        return self._steps[variant].lower(self.abstract_state(), self.batches.abstract(batch), inputs or {})

    def variant_cost(self, variant: str):
        """The `jaxpar.cost.hardware.StepCost` of step `variant` on `hardware` (compiled ahead of time if it has not
        run yet, e.g. a meeting step priced before the first meeting)."""
        if variant not in self.step_costs:
            self._price(variant, self.compiled_step(variant))
        return self.step_costs[variant]

    def evaluate(self, state: TrainState, batch) -> dict[str, jax.Array]:
        """`loss_fn`'s metrics in eval mode (no dropout, BatchNorm running averages) on one global batch."""
        self.check_state(state)
        placed = self.shard_batch(batch)
        try:
            return self._eval(state, placed)
        except ModelCallError as error:
            raise at_step(error, int(jax.device_get(state.step)), placed, "evaluate at step") from error.__cause__

    def params(self, state: TrainState) -> dict:
        """The full parameters, gathered from all shards, as a nested dict of numpy arrays."""
        self.check_state(state)
        # with several processes every process takes part: the shards other processes hold are gathered
        return jax.tree.map(np.asarray, nnx.to_pure_dict(to_host(state.params)))

    def fit(self, state: TrainState, batches: Iterable[Mapping], steps: int, actions: Iterable[Action] = (),
            on_step: Callable[[int, dict[str, float]], None] | None = None) -> TrainState:
        """Runs `steps` updates and the `actions` (see `jaxpar.actions`) as their steps' metrics become ready.

        At most two steps are in flight: before dispatching step N+1 the loop waits for step N-1's metrics.
        Unbounded dispatch of collective-bearing steps deadlocks XLA:CPU with many devices on few cores, and
        reading metrics one step late still overlaps host work with the device. An action that needs the state
        runs before the next step is dispatched (that step donates the state).

        `on_step(step, metrics)` is shorthand for an action called after every step. If the batch iterator runs
        out, a step is refused or an action raises, `fit` raises `FitError` carrying `.state` (the state after
        `.step` updates, never donated) and the cause. `steps` = 0 returns `state` unchanged.
        """
        return loop.fit(self, state, batches, steps, actions, on_step)
