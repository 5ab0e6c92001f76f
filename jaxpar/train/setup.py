"""What a Trainer is built from: its arguments checked, and the train state's layout (the model traced abstractly,
its stacks bound to how they run, every part of the state placed by the rules, the strategy's context and
shardings)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from flax import nnx

from jaxpar.checks import check_int
from jaxpar.errors import ConfigError, ModelError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd
from jaxpar.parallel.sharding_notes import ShardingNotes
from jaxpar.parallel.path_rules import normalize_path_rules
from jaxpar.pipeline.config import Pipeline
from jaxpar.pipeline.layer_run import LayerRun
from jaxpar.pipeline.stack import bind
from jaxpar.strategies import StepContext
from jaxpar.train.linen import LinenModel
from jaxpar.train.model_errors import call_factory
from jaxpar.train.remat import whole_forward
from jaxpar.train.step import TrainState, check_optimizer, split_model


# the strategy methods a Trainer calls (the core: jaxpar.strategies.base.Strategy)
TRAINER_NEEDS = ("init", "reduce", "shardings", "steps", "plan")


def check_arguments(model, loss_fn, eval_loss_fn, optimizer, mesh, strategy, grad_accum, skip_nonfinite) -> None:
    """Each bad Trainer argument as one `JaxparError` naming it."""
    mesh_lib.check_mesh(mesh)
    if isinstance(model, nnx.Module) or not callable(model):
        raise ModelError(f"model: got {type(model).__name__}; pass a function rngs -> nnx.Module (the class "
                         f"itself, or lambda rngs: MyModel(..., rngs=rngs)), not a built module")
    for argument, fn in (("loss_fn", loss_fn), ("eval_loss_fn", eval_loss_fn or loss_fn)):
        if not callable(fn):
            raise ModelError(f"{argument} {fn!r}: not a function; {argument} is (model, batch[, rngs]) -> "
                             f"(scalar loss, dict of metrics)")
    check_optimizer("optimizer", optimizer)
    check_int("grad_accum", grad_accum, 1, "microbatches per update")
    if strategy is not None:
        missing = [m for m in TRAINER_NEEDS if not callable(getattr(strategy, m, None))] + (
            [] if hasattr(strategy, "name") else ["name"])
        if missing:
            raise ConfigError(f"strategy {strategy!r}: not a strategy (it lacks {', '.join(missing)}; see "
                              f"jaxpar.strategies.base.Strategy); pass e.g. jaxpar.Sync(), jaxpar.LocalSGD(period=4) "
                              f"or jaxpar.SSP(staleness=2), or write one (the example in jaxpar.strategies.Strategy)")
    if not isinstance(skip_nonfinite, bool):
        raise ConfigError(f"skip_nonfinite {skip_nonfinite!r}: must be True (skip a step whose loss or update is "
                          f"not finite) or False (apply it)")


def check_pipeline(pipeline) -> Pipeline:
    """The trainer's `Pipeline` (default GPipe, one microbatch); anything else is a ConfigError."""
    if pipeline is None:
        return Pipeline()
    if not isinstance(pipeline, Pipeline):
        raise ConfigError(f"pipeline {pipeline!r}: pass a jaxpar.pipeline.Pipeline, e.g. "
                          f"Pipeline('1f1b', microbatches=4)")
    return pipeline


class StateLayout(NamedTuple):
    ctx: StepContext  # what the strategy builds its steps from
    eval_graphdef: Any  # the model's structure in eval mode
    neutral_shardings: TrainState  # of the strategy-free state
    state_shardings: TrainState  # of the strategy's state
    notes: ShardingNotes  # what placing the state decided that the user should hear
    model: Any  # the abstract model (`under` binds it again under another remat policy)
    loss_fn: Any  # the loss as given (three-argument form), before any remat
    pipeline: Pipeline

    def under(self, remat) -> StepContext:
        """`ctx` with the model's stacks (or its whole forward) under the remat policy `remat` instead: what a
        trainer's steps under another policy are built from (`Trainer.compiled_step(..., remat=...)`)."""
        graphdef, loss_fn = bound(self.model, self.loss_fn, self.ctx.mesh, self.pipeline, remat)
        return self.ctx._replace(graphdef=graphdef, loss_fn=loss_fn)


def bound(model, loss_fn, mesh, pipeline: Pipeline, remat) -> tuple:
    """(training graphdef, loss the step differentiates) of the abstract `model`: every Stack bound to run by `mesh`,
    `pipeline` and the `remat` policy; a model without one has `remat` over its whole forward instead."""
    model.train()
    if not bind(model, LayerRun(mesh, pipeline, remat)) and remat is not None:
        loss_fn = whole_forward(loss_fn, remat)
    return split_model(model)[0], loss_fn


def state_layout(model, loss_fn, optimizer, mesh, rules, strict: bool, strategy, grad_accum: int,
                 skip_nonfinite: bool, path_rules=None, pipeline: Pipeline | None = None, remat=None) -> StateLayout:
    """Traces `model` abstractly (nothing allocated), binds its stacks to `pipeline` and `remat` (`bound`), and
    places every part of the train state: parameters by `path_rules` where one matches, else by their logical names
    and `rules` (`strict`: an fsdp placement that does not divide is an error and unnamed parameters stay whole;
    otherwise both go where fsdp divides), model state by `rules`, optimizer state like the parameters, the rest
    replicated; then the strategy adds its own."""
    shd.validate_rules(rules, mesh)
    if mesh_lib.own_names(mesh) and mesh_lib.size(mesh, mesh_lib.STAGE_AXIS) > 1:
        raise ConfigError(f"mesh {mesh_lib.shape_line(mesh)}: a pipeline (stage > 1) is not built yet on a mesh "
                          f"with the model's own axis names or Explicit axes; use make_mesh without roles / "
                          f"axis_types for pipeline parallelism")
    path_rules = normalize_path_rules(path_rules)
    if not isinstance(strict, bool):
        raise ConfigError(f"strict {strict!r}: must be True (an fsdp placement that does not divide is an error) or "
                          f"False (it moves to a dimension that divides, or the parameter stays whole)")
    with mesh_lib.tracing(mesh), nnx.use_eager_sharding(False):  # a model's own partition specs need the mesh
        abstract = nnx.eval_shape(lambda: call_factory(model, nnx.Rngs(0)))
    if not isinstance(abstract, nnx.Module):
        raise ModelError(f"model: the factory returned {type(abstract).__name__}, not an nnx.Module; it must be "
                         f"rngs -> nnx.Module (a Linen module: wrap it with jaxpar.from_linen)")
    pipeline = pipeline or Pipeline()
    bind(abstract, LayerRun(mesh, pipeline, remat))
    abstract.eval()
    eval_graphdef = split_model(abstract)[0]
    graphdef, bound_loss = bound(abstract, loss_fn, mesh, pipeline, remat)
    _, abs_params, abs_model_state = split_model(abstract)

    linen_model = isinstance(abstract, LinenModel)
    notes = ShardingNotes(library="linen" if linen_model else "nnx")
    # a wrapped Linen module's parameters sit under the wrapper's `linen` attribute: path rules see Linen's paths
    param_sh = shd.state_shardings(abs_params, rules, mesh, strict, notes, path_rules, path_root=int(linen_model))
    model_state_sh = shd.state_shardings(abs_model_state, rules, mesh, strict)
    opt_sh = shd.optimizer_shardings(optimizer, jax.eval_shape(optimizer.init, abs_params), param_sh, mesh)
    ctx = StepContext(graphdef, abs_params, bound_loss, optimizer, mesh, param_sh, model_state_sh, opt_sh, grad_accum,
                      getattr(strategy, "communicator", None), skip_nonfinite)
    comm = ctx.communicator
    comm_sh = () if comm is None else shd.communicator_shardings(
        jax.eval_shape(lambda p: comm.init_state(p, ctx.num_replicas), abs_params), param_sh, mesh)
    neutral = TrainState(shd.replicated(mesh), param_sh, model_state_sh, opt_sh, (), shd.replicated(mesh), comm_sh)
    return StateLayout(ctx, eval_graphdef, neutral, strategy.shardings(ctx, neutral), notes, abstract, loss_fn,
                       pipeline)
