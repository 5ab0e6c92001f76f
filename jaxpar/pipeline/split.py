"""1F1B's training step: the loss cut at the model's one `Stack` into the part before it, the stacked layers and
the part after it, so the last stage can apply the rest of the model and the loss to each microbatch as it leaves
and start its backward at once.

Nothing of the user's model or loss changes. The loss function is traced three ways, the stack's `tap` standing in
for its layers in the first and the last:
- `Capture`: the whole loss on the whole batch with the stack recording its input (the rest is dead code and
  compiled away); its `jax.vjp` later turns the stack input's cotangent into the gradients of the part before;
- the stacked layers, stage by stage, in `one_f_one_b`;
- `Replace`: the loss on microbatch m with the stack returning its output (the part before is dead code): the
  head that `one_f_one_b` differentiates on the last stage.

The mesh, `Pipeline` and remat policy are the stack's `LayerRun` (bound by the trainer); the loss comes in as a
function `loss_of(model, batch, key) -> (loss, metrics)` (`jaxpar.train.step` passes the user's, checked).

The step's loss and metrics are their means over microbatches (and over data shards, each stage map running its own
rows), which equal the whole batch's for a loss and metrics that are means over examples (as under gradient
accumulation). The model's non-parameter state is updated by the part before the stack (the capture pass); layers
after the stack draw dropout per microbatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import ModelError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd
from jaxpar.pipeline import shard_keys
from jaxpar.pipeline.schedules import one_f_one_b
from jaxpar.pipeline.stack import Stack, merge_microbatches, split_microbatches


def the_stack(model) -> tuple[tuple, Stack]:
    """(path, module) of the model's one Stack; a ModelError names what 1F1B needs otherwise."""
    found = [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, Stack)]
    if len(found) != 1:
        what = "no jaxpar.pipeline.Stack" if not found else f"{len(found)} jaxpar.pipeline.Stack modules"
        raise ModelError(f"--pipeline 1f1b: the model has {what}; 1F1B pipelines exactly one stack of blocks (use "
                         f"--pipeline gpipe or circular for several)")
    return found[0]


class Capture:
    """A stack's tap that records what the layers are called with and returns their input."""

    def __init__(self):
        self.x = self.args = self.key = None

    def __call__(self, stack, x, args, key):
        if self.x is not None:  # a second call: its input would overwrite the first's, its output be wrong
            raise ModelError("--pipeline 1f1b (Pipeline('1f1b')): the model calls its jaxpar.pipeline.Stack more "
                             "than once per step; 1F1B pipelines one pass through one stack (use --pipeline "
                             "gpipe or circular, which pipeline every call)")
        self.x, self.args, self.key = x, args, key
        return x


class Replace:
    """A stack's tap that returns `output` (the layers' output, computed by the stages)."""

    def __init__(self, output):
        self.output = output

    def __call__(self, stack, x, args, key):
        return self.output


def tapped(model, tap):
    """`model` (a merged copy) with its one stack's tap set to `tap`: (the stack, the tap)."""
    stack = the_stack(model)[1]
    stack.tap = tap
    return stack, tap


def _head_inputs(mesh, micro, y):
    """The microbatch and the stack's output as the head sees them on the last stage.

    With the batch split (data or fsdp > 1) and a model axis > 1, leaving their rows split inside the stage-manual
    shard_map crashes XLA's SPMD partitioner for a head with a tensor-parallel vocabulary (jax 0.10.2: "Check
    failed: partition_group_list..."; `python run.py --mesh data=2,stage=2,model=2 --pipeline 1f1b` aborted).
    Replicating both over the stage's devices avoids it: every device of the last stage then computes the head on
    the whole microbatch (the head's compute is not split over the batch axes; the stages' layers still are)."""
    if mesh_lib.size(mesh, mesh_lib.BATCH_AXES) > 1 and mesh_lib.size(mesh, mesh_lib.TENSOR_AXIS) > 1:
        return shd.replicate_within(micro), shd.replicate_within(y)
    return micro, y


def loss_and_grad(graphdef, loss_of, params, model_state, batch, key):
    """`jaxpar.train.step.loss_and_grad` under 1F1B on a stage mesh: (loss, metrics, new model_state, grads).
    `loss_of(model, batch, key)`: the user's loss on `model` with the streams of the typed `key`."""
    path, stack = the_stack(nnx.merge(graphdef, params, model_state))
    mesh, pipeline, remat = stack.run.mesh, stack.run.pipeline, stack.run.remat
    stages = mesh_lib.size(mesh, mesh_lib.STAGE_AXIS)
    count = pipeline.microbatches
    prefix = tuple(path) + ("layers",)

    def pre(p):
        model = nnx.merge(graphdef, p, model_state)
        capturing, capture = tapped(model, Capture())
        loss_of(model, batch, key)
        capturing.tap = None
        return capture.x, (capture.args, capture.key, nnx.split(model, nnx.Param, ...)[2])

    x, pull_pre, (args, stack_key, new_model_state) = jax.vjp(pre, params, has_aux=True)
    pipeline.check_layers(stack.num_layers, stages, "jaxpar.pipeline.Stack")
    pipeline.check_microbatches(x.shape[0], stages, "the batch reaching jaxpar.pipeline.Stack",
                                shd.stage_row_shards(mesh))
    per = stack.num_layers // stages
    in_stack = lambda p, _: tuple(p[:len(prefix)]) == prefix  # noqa: E731
    stack_params, other_params = nnx.split_state(params, in_stack, ...)
    layer_graphdef, _, rest = nnx.split(stack.layers, nnx.Param, ...)
    stack._check_stateless(rest, stages)

    rows_axis = shd.stage_rows_axis(mesh)

    def body(stack_p, other_p, state, batch, xs, args, key, step_key):
        shard = None if rows_axis is None else (jax.lax.axis_index(rows_axis) * xs.shape[1], xs.shape[1])
        run = stack._chunk(layer_graphdef, args, key, remat, shard)
        stage = jax.lax.axis_index(mesh_lib.STAGE_AXIS)

        def stage_fn(layers, x, m):
            return run(layers, rest, x, m, stage * per)[0]

        def head_fn(other, y, m):
            model = nnx.merge(graphdef, nnx.merge_state(other, stack_p), state)
            micro, y = _head_inputs(mesh, jax.tree.map(lambda a: split_microbatches(a, count)[m], batch), y)
            tapped(model, Replace(y))
            # each microbatch its own streams: the same key would repeat one dropout mask on every microbatch
            key_m = jax.random.fold_in(jax.random.wrap_key_data(step_key), m)
            if shard is not None:  # this data shard's rows of the microbatch's masks
                key_m = shard_keys.shard_key(key_m, *shard)
            return loss_of(model, micro, key_m)

        return one_f_one_b(stage_fn, head_fn, stack_p, other_p, xs, axis=mesh_lib.STAGE_AXIS, rows_axis=rows_axis)

    # each data shard runs its own rows of the batch and of every microbatch; one_f_one_b averages over data
    whole, split = shd.REPLICATED, shd.STAGE_SPLIT
    batch_rows, micro_rows = shd.stage_rows(mesh, 0), shd.stage_rows(mesh, 1)
    mapped = shd.over_stages(body, mesh, (split, whole, whole, batch_rows, micro_rows, whole, whole, whole),
                             (whole, whole, split, whole, micro_rows))
    loss, metrics, stack_grads, other_grads, input_grads = mapped(
        stack_params, other_params, model_state, batch, split_microbatches(x, count), args, stack_key,
        jax.random.key_data(key))
    (pre_grads,) = pull_pre(merge_microbatches(input_grads).astype(x.dtype))
    grads = jax.tree.map(jnp.add, pre_grads, nnx.merge_state(other_grads, stack_grads))
    return loss, metrics, new_model_state, grads
