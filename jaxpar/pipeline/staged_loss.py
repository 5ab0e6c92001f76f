"""`loss_and_grad` of a model whose Stack runs over a stage axis: the loss cut at the stack (`jaxpar.pipeline.split`)
and every part of the model inside the schedule, one microbatch per tick (`jaxpar.pipeline.schedules`).

- GPipe and circular (`circular_loss`): stage 0 computes each microbatch's stack input in the tick that runs it, the
  last stage the head and the loss in the tick the microbatch leaves; the backward is autodiff through the ticks
  inside the stage map, each tick rematerialised, so a tick keeps one activation (its input) for the backward. The
  gradients of the parameters outside the stack are summed over the stages, and every gradient averaged over data
  in one psum after the loop, as under 1F1B.
- 1F1B (`one_f_one_b`): the same parts in its forward half-steps; stage 0 pulls each backward's input gradient
  through the part before the stack at once.

Outside the stage map only the whole batch's trace of the stack's call remains (its arguments, key and the model's
new non-parameter state), whose activations are dead code: no array of the size of the whole batch's activations
is computed or kept, and nothing is replicated over the stage devices but the (integer) batch.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd
from jaxpar.pipeline.config import ONE_F_ONE_B
from jaxpar.pipeline.one_f_one_b import one_f_one_b
from jaxpar.pipeline.schedules import circular_loss
from jaxpar.pipeline.split import cut, model_parts, the_stack


def loss_and_grad(graphdef, loss_of, params, model_state, batch, key):
    """`jaxpar.train.step.loss_and_grad` on a stage mesh: (loss, metrics, new model_state, grads), or None when
    GPipe / circular keep their plain step (a model with several stacks, or calling its stack more than once).
    `loss_of(model, batch, key)`: the user's loss on `model` with the streams of the typed `key`."""
    model = nnx.merge(graphdef, params, model_state)
    found = the_stack(model, strict=False)
    schedule = found[1].run.pipeline.schedule if found else ONE_F_ONE_B
    cutting = cut(graphdef, loss_of, params, model_state, batch, key, strict=schedule == ONE_F_ONE_B)
    if cutting is None:
        return None
    path, stack, capture, new_model_state = cutting
    mesh, pipeline, remat = stack.run.mesh, stack.run.pipeline, stack.run.remat
    stages, count, rounds = mesh_lib.size(mesh, mesh_lib.STAGE_AXIS), pipeline.microbatches, pipeline.rounds
    pipeline.check_layers(stack.num_layers, stages, "jaxpar.pipeline.Stack")
    pipeline.check_microbatches(capture.x.shape[0], stages, "the batch reaching jaxpar.pipeline.Stack",
                                shd.stage_row_shards(mesh))
    per = stack.num_layers // (stages * rounds)
    prefix = tuple(path) + ("layers",)
    in_stack = lambda p, _: tuple(p[:len(prefix)]) == prefix  # noqa: E731
    stack_params, other_params = nnx.split_state(params, in_stack, ...)
    layer_graphdef, _, rest = nnx.split(stack.layers, nnx.Param, ...)
    stack._check_stateless(rest, stages)
    rows_axis = shd.stage_rows_axis(mesh)
    axis = mesh_lib.STAGE_AXIS

    def parts(stack_p, state, batch, args, key, step_key, rows):
        """(stage_fn(chunk, x, m, r), first, head) inside the stage map."""
        shard = None if rows_axis is None else (jax.lax.axis_index(rows_axis) * rows, rows)
        run = stack._chunk(layer_graphdef, args, key, remat, shard)
        stage = jax.lax.axis_index(axis)

        def stage_fn(layers, x, m, r=0):
            return run(layers, rest, x, m, (r * stages + stage) * per)[0]

        first, head = model_parts(graphdef, loss_of, stack_p, state, batch, step_key, count, mesh, rows_axis)
        return stage_fn, first, head

    rows_of = lambda batch: jax.tree.leaves(batch)[0].shape[0] // count  # noqa: E731
    whole, split = shd.REPLICATED, shd.STAGE_SPLIT
    batch_rows = shd.stage_rows(mesh, 0)
    step_key = jax.random.key_data(key)
    if schedule == ONE_F_ONE_B:
        def body(stack_p, other_p, state, batch, args, key, step_key):
            stage_fn, first, head = parts(stack_p, state, batch, args, key, step_key, rows_of(batch))
            loss, metrics, grads, other_grads, _ = one_f_one_b(
                stage_fn, head, stack_p, other_p, first, axis=axis, rows_axis=rows_axis, count=count,
                uniform=mesh_lib.seq_ways(mesh) > 1)
            return loss, metrics, grads, other_grads

        mapped = shd.over_stages(body, mesh, (split, whole, whole, batch_rows, whole, whole, whole),
                                 (whole, whole, split, whole))
        loss, metrics, stack_grads, other_grads = mapped(stack_params, other_params, model_state, batch,
                                                         capture.args, capture.key, step_key)
        return loss, metrics, new_model_state, nnx.merge_state(other_grads, stack_grads)

    shards = shd.stage_row_shards(mesh)

    def body(by_stage, other_p, state, batch, args, key, step_key):
        chunks = jax.tree.map(lambda a: a[0], by_stage)  # this stage's [R, k, ...]
        stage_fn, first, head = parts(chunks, state, batch, args, key, step_key, rows_of(batch))

        def mine(chunks, other):  # this (stage, data shard)'s share of the mean loss: the last stage's, else 0
            loss, metrics = circular_loss(stage_fn, first, head, chunks, other, count, axis=axis, repeats=rounds)
            scale = lambda a: a / (count * shards)  # noqa: E731
            return scale(loss), jax.tree.map(scale, metrics)

        # the backward inside the map (the ticks in reverse, the permutes transposed): each device's gradients of
        # the whole loss for its own chunks, and its own uses' share for the parameters outside the stack
        (loss, metrics), (grads, other_grads) = jax.value_and_grad(mine, argnums=(0, 1), has_aux=True)(
            chunks, other_p)
        loss, metrics, other_grads = jax.lax.psum((loss, metrics, other_grads), axis)
        if rows_axis is not None:  # the gradient average over data: one psum, once per step
            loss, metrics, other_grads, grads = jax.lax.psum((loss, metrics, other_grads, grads), rows_axis)
        return loss, metrics, jax.tree.map(lambda a: a[None], grads), other_grads

    mapped = shd.over_stages(body, mesh, (split, whole, whole, batch_rows, whole, whole, whole),
                             (whole, whole, split, whole))
    loss, metrics, by_stage_grads, other_grads = mapped(
        stack.by_stage(stack_params, stages, rounds), other_params, model_state, batch, capture.args, capture.key,
        step_key)
    stack_grads = jax.tree.map(lambda g, p: g.swapaxes(0, 1).reshape(p.shape), by_stage_grads, stack_params)
    return loss, metrics, new_model_state, nnx.merge_state(other_grads, stack_grads)
