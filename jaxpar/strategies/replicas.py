"""Per-replica plumbing shared by the explicit-collective strategies, and the ONE per-replica step body.

Inside `per_replica(...)` (a `jax.shard_map` manual over the replica axis only) each replica runs its own copy of
the code on its slice of the batch, while the within-replica axes (fsdp, model) stay with the compiler, so FSDP and
tensor parallelism keep working unchanged (with fsdp and model both larger than 1, the loss and gradient split
the rows over fsdp by hand: `_replica_loss_and_grad`). Per-replica copies of parameters live in arrays with a
leading replica dimension sharded over the replica axis (and over fsdp / model inside, like the parameters).

`replica_step` is the body every explicit strategy shares (Sync with a hand-written allreduce, LocalSGD / DiLoCo,
SSP / ASP): fold the replica index into the keys, loss and gradient on the replica's slice, average the gradient
over the replicas (optionally only over the participating ones), restore the keys, average BatchNorm statistics,
mean the metrics.

The step body, the averages it calls and the guard it applies share the replica layout (which axis is manual,
which copies are stacked). The codecs (`jaxpar.parallel.compression`, `fsdp_reduce`) and the metric means on the
host side (`jaxpar.train.replica_metrics`) live apart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import fsdp_reduce
from jaxpar.parallel import partitioning as shd
from jaxpar.parallel.collectives import allreduce_in_one_buffer
from jaxpar.parallel.compression import CompressedCommunicator
from jaxpar.runtime.distributed import one_buffer_gradients
from jaxpar.train.faults import finite_within, select_tree
from jaxpar.train.step import loss_and_grad

AXIS = mesh_lib.REPLICA_AXIS
SHARDED = shd.PER_REPLICA  # one entry per replica
BATCH = shd.PER_REPLICA  # the batch's rows, one slice per replica
SAME = shd.REPLICATED  # the same on every replica


def per_replica(ctx, fn, in_specs, out_specs):
    """`fn` runs once per replica; the within-replica axes stay automatic.

    `check_vma=False`: results averaged by the hand-written collectives are replicated in value, but only a native
    collective lets shard_map's type check prove it.
    """
    return jax.shard_map(fn, mesh=ctx.mesh, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS},
                         check_vma=False)


def mean_params_like(ctx, tree, comm_state=()):
    """Mean over replicas of a params-shaped tree (gradients, parameters), each device on its own shard.

    The hand-written algorithms fuse leaves into one flat buffer; done on the global (fsdp / model-sharded) arrays,
    that flattening would first all-gather every sharded leaf. A nested shard_map manual over every within-replica
    axis makes each device fuse and send only its own shard: the bytes over the replica axis shrink by the
    within-replica sharding.
    """
    comm = ctx.communicator
    if _single_replica():
        return tree, comm_state
    if comm.native and one_buffer_gradients(ctx.mesh):
        return allreduce_in_one_buffer(tree, AXIS), comm_state
    # an elementwise codec may put leaves split over the same within-replica axes into one chunk (`Exchange`)
    compressing = isinstance(comm, CompressedCommunicator)
    if comm.native or mesh_lib.size(ctx.mesh, mesh_lib.WITHIN_REPLICA_AXES) == 1:
        groups = {"groups": [()] * len(jax.tree.leaves(tree))} if compressing else {}
        return comm.mean(tree, comm_state, AXIS, **groups)
    if not getattr(comm, "per_shard", True):  # PowerSGD: whole matrices (the compiler shards its matmuls), and
        return comm.mean(tree, comm_state, AXIS, shardings=ctx.param_shardings)  # each device sends its factor rows
    specs = shd.within_replica_specs(ctx.param_shardings)
    state_specs = shd.communicator_specs(comm_state, ctx.param_shardings)
    groups = {"groups": [shd.within_replica_axes(s) for s in jax.tree.leaves(
        ctx.param_shardings, is_leaf=lambda x: hasattr(x, "spec"))]} if compressing else {}
    # no `mesh=`: inside the outer shard_map the context mesh (replica axis already manual) is the one to use
    return jax.shard_map(lambda t, s: comm.mean(t, s, AXIS, **groups), in_specs=(specs, state_specs),
                         out_specs=(specs, state_specs), axis_names=set(mesh_lib.WITHIN_REPLICA_AXES),
                         check_vma=False)(tree, comm_state)


def _single_replica() -> bool:
    """One replica: its mean is itself. Skipping the collective is also needed: a psum over a replica axis of size
    1 with fsdp larger than 1 crashes XLA's SPMD partitioner (jax 0.10.2: "Cross-partition allreduce must be in
    (partial) manual partitioning mode")."""
    return lax.axis_size(AXIS) == 1


def replica_index():
    return lax.axis_index(AXIS)


def participants(weight):
    """How many replicas have weight > 0: an integer sum, exact for any replica count."""
    if _single_replica():
        return (weight > 0).astype(jnp.int32)
    return lax.psum((weight > 0).astype(jnp.int32), AXIS)


def mean_over(ctx, tree, weight=None, params_like=False, comm_state=()):
    """Mean over replicas; with `weight` (this replica's participation), the mean over participants only.

    Non-participants are masked with a select, not a multiply: a non-finite value of a replica that does not
    take part must not leak into the mean (0 x NaN = NaN).
    """
    if weight is not None:
        tree = jax.tree.map(lambda x: jnp.where(weight > 0, x, jnp.zeros_like(x)), tree)
    if params_like:
        tree, comm_state = mean_params_like(ctx, tree, comm_state)  # (one replica: returned as it is)
    elif not _single_replica():
        tree, comm_state = ctx.communicator.mean(tree, comm_state, AXIS)
    if weight is not None:
        scale = ctx.num_replicas / jnp.maximum(participants(weight), 1).astype(jnp.float32)
        tree = jax.tree.map(lambda x: (x * scale).astype(x.dtype), tree)
    return tree, comm_state


def native_mean(tree, weight=None):
    """Mean over (participating) replicas with XLA's own all-reduce: for metrics and BatchNorm statistics, which are
    small and must not go through a (possibly lossy, stateful) gradient communicator."""
    if _single_replica():
        return tree if weight is None else jax.tree.map(lambda x: jnp.where(weight > 0, x, jnp.zeros_like(x)), tree)
    if weight is None:
        return lax.pmean(tree, AXIS)
    masked = jax.tree.map(lambda x: jnp.where(weight > 0, x, jnp.zeros_like(x)), tree)
    count = jnp.maximum(participants(weight), 1).astype(jnp.float32)
    return jax.tree.map(lambda x: (lax.psum(x, AXIS) / count).astype(x.dtype), masked)


def _map_rng_keys(fn, model_state):
    return jax.tree.map(lambda v: v.replace(fn(v)) if isinstance(v, nnx.RngKey) else v, model_state,
                        is_leaf=shd.is_variable)


def fold_rng_keys(model_state, index):
    """Each replica draws its own dropout masks: the same seed never gives two replicas the same mask."""
    return _map_rng_keys(lambda v: jax.random.fold_in(v.get_value(), index), model_state)


def unfold_rng_keys(new_model_state, original_model_state):
    """Keeps the updated RNG counters but the original (replica-independent) keys."""
    originals = iter(v.get_value() for v in jax.tree.leaves(original_model_state, is_leaf=shd.is_variable)
                     if isinstance(v, nnx.RngKey))
    return _map_rng_keys(lambda v: next(originals), new_model_state)


def mean_batch_stats(model_state, weight=None):
    """Averages BatchNorm statistics (and nothing else: a user's EMA or cache stays per replica) over replicas."""
    leaves, treedef = jax.tree.flatten(model_state, is_leaf=shd.is_variable)
    stats = [i for i, v in enumerate(leaves) if isinstance(v, nnx.BatchStat)
             and jnp.issubdtype(v.get_value().dtype, jnp.floating)]
    if stats:
        averaged = native_mean([leaves[i].get_value() for i in stats], weight)
        for i, value in zip(stats, averaged):
            leaves[i] = leaves[i].replace(value)
    return jax.tree.unflatten(treedef, leaves)


def replica_step(ctx, params, model_state, batch, key, *, average: bool = True, weight=None, comm_state=(),
                 mean_metrics: bool = True):
    """The per-replica step body, inside `per_replica`. Returns (grads, model_state, metrics, comm_state).

    `key` is the step's typed key; this replica's key is `fold_in(key, replica index)`, and model-owned RNG keys
    are folded the same way (and restored afterwards, so the state stays replica-independent). `average=False`
    (local SGD's local step): the gradient and BatchNorm statistics stay this replica's own; `mean_metrics=False`:
    so do the metrics (nothing at all crosses the replica axis).
    """
    index = replica_index()
    own_state = fold_rng_keys(model_state, index)
    loss, metrics, new_state, grads = _replica_loss_and_grad(ctx, params, own_state, batch,
                                                             jax.random.fold_in(key, index),
                                                             _fsdp_codec(ctx) if average else None)
    new_state = unfold_rng_keys(new_state, model_state)
    metrics = {"loss": loss, **metrics}
    if average and mean_metrics and ctx.communicator.native and not _single_replica():
        # XLA's all-reduce: gradients and metrics (and a server update's participant count) in ONE all-reduce
        if weight is None:
            mean = allreduce_in_one_buffer if one_buffer_gradients(ctx.mesh) else lax.pmean
            grads, metrics = mean((grads, metrics), AXIS)
        else:
            grads, metrics = _weighted_mean_in_one(grads, metrics, weight, one_buffer_gradients(ctx.mesh))
        return grads, mean_batch_stats(new_state, weight), metrics, comm_state
    if average:
        grads, comm_state = mean_over(ctx, grads, weight, params_like=True, comm_state=comm_state)
        new_state = mean_batch_stats(new_state, weight)
    return grads, new_state, native_mean(metrics, weight) if mean_metrics else metrics, comm_state


def _keep_or_flag(ctx, ok, old, new, metrics):
    """Under skip: `new` where `ok`, else `old`, and `skipped` = 1 where not ok; otherwise `new` and `nonfinite`
    = 1 where not ok (a flag already set in `metrics` stays set)."""
    flag = "skipped" if ctx.skip_nonfinite else "nonfinite"
    failed = (~ok).astype(jnp.float32)
    metrics = {**metrics, flag: jnp.maximum(metrics[flag], failed) if flag in metrics else failed}
    return (select_tree(ok, new, old) if ctx.skip_nonfinite else new), metrics


def guard_meeting(ctx, old, new, metrics):
    """Inside `per_replica`, after a meeting: `new` (this replica's copy and the anchor) if the averaged result is
    finite, else (skip) `old` for the whole meeting; the result is the same on every replica, so every replica
    decides the same without asking the others. Marks `skipped` / `nonfinite` as 1 when the meeting failed."""
    return _keep_or_flag(ctx, finite_within(new[1]), old, new, metrics)


def _weighted_mean_in_one(grads, metrics, weight, one_buffer: bool = False):
    """The participants' mean of the gradients and of the metrics, with one all-reduce over the replicas (a
    participant count rides along): SSP / ASP pay one latency term per update, not two. Non-participants
    are masked with a select (0 x NaN would be NaN)."""
    taking_part = weight > 0
    masked = jax.tree.map(lambda x: jnp.where(taking_part, x, jnp.zeros_like(x)), (grads, metrics))
    both = (masked, taking_part.astype(jnp.float32))
    total, count = allreduce_in_one_buffer(both, AXIS, reduce=lax.psum) if one_buffer else lax.psum(both, AXIS)
    count = jnp.maximum(count, 1.0)
    return jax.tree.map(lambda x: (x / count).astype(x.dtype), total)


def guard_finite(ctx, old, new, metrics):
    """Inside `per_replica`: this replica's `new` state if its loss and every floating-point leaf are finite, else
    (with `ctx.skip_nonfinite`) its `old` one; adds the metric `skipped` (or `nonfinite` when not skipping). The
    check reduces only within the replica (its fsdp / model devices): other replicas are not asked."""
    return _keep_or_flag(ctx, jnp.isfinite(metrics["loss"]) & finite_within(new), old, new, metrics)


def _replica_loss_and_grad(ctx, params, model_state, batch, key, codec=None):
    """Loss, metrics, model state and gradients of the replica's slice, each of its devices computing its own share.

    With both fsdp and model larger than 1, letting the compiler split the slice's rows over fsdp inside the
    replica-manual shard_map crashes XLA's SPMD partitioner (jax 0.10.2, Shardy on: "Check failed:
    partition_group_list..." in ExpandDeviceGroupsWithIota) at any gather or scatter whose batch dimension is split
    over fsdp while another dimension is split over model or fsdp: a tensor-parallel embedding lookup, its gradient,
    the cross-entropy's `take_along_axis` on vocabulary-split logits. So the rows are split over fsdp by hand: a
    nested shard_map manual over fsdp (model stays with the compiler) takes the parameters whole over fsdp (ZeRO-3's
    all-gather), runs the step body on this device's rows with the fsdp index folded into its keys (no two devices
    draw the same dropout mask) and averages loss, metrics and gradients over fsdp.

    Where that would change what the model computes, the slice is instead replicated over the replica's devices
    (each fsdp device then does the whole slice's elementwise work; the partitioner still splits the matmuls over
    the fsdp-sharded contracting dimension): a model with state other than its RNG state (BatchNorm statistics
    must be the slice's, not a device's share), a pipeline (the stage axis has its own schedule).
    """
    if not _rows_split_by_hand(ctx, model_state, batch, codec):
        return loss_and_grad(ctx.graphdef, ctx.loss_fn, params, model_state, _within_replica_batch(ctx, batch), key,
                             ctx.grad_accum)
    fsdp = mesh_lib.axis_name(ctx.mesh, mesh_lib.FSDP_AXIS)
    by_hand = codec is not None  # the gradient leaves unreduced and is reduce-scattered by fsdp_reduce

    def own_rows(params, model_state, batch, key):
        index = lax.axis_index(fsdp)
        loss, metrics, new_state, grads = loss_and_grad(ctx.graphdef, ctx.loss_fn, params,
                                                        fold_rng_keys(model_state, index), batch,
                                                        jax.random.fold_in(key, index), ctx.grad_accum)
        if by_hand:
            loss, metrics = lax.pmean((loss, metrics), fsdp)
            grads = jax.tree.map(lambda g: g[None], grads)
        else:
            loss, metrics, grads = lax.pmean((loss, metrics, grads), fsdp)
        return loss, metrics, unfold_rng_keys(new_state, model_state), grads

    same, rows = shd.REPLICATED, shd.fsdp_rows(ctx.mesh)
    grads_out = shd.per_fsdp_device(ctx.mesh) if by_hand else same
    # no `mesh=`: inside the outer shard_map the context mesh (replica axis already manual) is the one to use
    loss, metrics, new_state, grads = jax.shard_map(
        own_rows, in_specs=(same, same, rows, same), out_specs=(same, same, same, grads_out), axis_names={fsdp},
        check_vma=False)(params, model_state, batch, key)
    if by_hand:
        grads = fsdp_reduce.reduce_scatter(grads, ctx.param_shardings, ctx.mesh, codec)
    return loss, metrics, new_state, grads


def _fsdp_codec(ctx):
    """The codec of the gradient's fsdp leg (`jaxpar.parallel.fsdp_reduce`) of a step that averages its gradient
    with a compressing communicator: that communicator's codec (Sync's `compress`; None: the fsdp mean is the pmean
    of before). A local step (local SGD / DiLoCo, whose codec is for the meetings) passes None: its fsdp leg stays
    uncompressed, like their warm-up steps."""
    return getattr(ctx.communicator, "codec", None)


def fsdp_leg_codec(strategy, ctx, variant: str, model_state, replica_batch):
    """The codec that compresses the gradient's fsdp leg in `variant`'s step (`jaxpar.parallel.fsdp_reduce`), or
    None: the strategy averages that variant's gradient with its codec (`strategy.fsdp_leg_codec`, Sync's) and the
    replica's rows are split over fsdp by hand (`_rows_split_by_hand`). `replica_batch`: one replica's slice (only
    its shapes are read). What `--explain`'s fsdp theory and the plan advisor price."""
    codec = getattr(strategy, "fsdp_leg_codec", lambda variant: None)(variant)
    return codec if codec is not None and _rows_split_by_hand(ctx, model_state, replica_batch, codec) else None


def _rows_split_by_hand(ctx, model_state, batch, codec=None) -> bool:
    """fsdp larger than 1 and either model larger than 1 or a codec (its fsdp leg needs the unreduced gradient), no
    pipeline, each device's rows divisible into `grad_accum`
    microbatches, and a model whose only state is its RNG state: a variable the model updates from its batch
    (BatchNorm statistics, a user's EMA) must see the replica's whole slice."""
    mesh = ctx.mesh
    fsdp = mesh_lib.size(mesh, mesh_lib.FSDP_AXIS)
    only_rng_state = all(isinstance(v, nnx.RngState) for v in jax.tree.leaves(model_state, is_leaf=shd.is_variable))
    rows = {x.shape[0] for x in jax.tree.leaves(batch)}
    by_hand = mesh_lib.size(mesh, mesh_lib.TENSOR_AXIS) > 1 or codec is not None
    return (fsdp > 1 and by_hand and mesh_lib.size(mesh, mesh_lib.STAGE_AXIS) == 1
            and only_rng_state and all(r % (fsdp * ctx.grad_accum) == 0 for r in rows))


def _within_replica_batch(ctx, batch):
    """The replica's slice, replicated over its devices where the compiler may not split its rows (see
    `_replica_loss_and_grad`)."""
    if mesh_lib.size(ctx.mesh, mesh_lib.FSDP_AXIS) > 1 and mesh_lib.size(ctx.mesh, mesh_lib.TENSOR_AXIS) > 1:
        return shd.replicate_within(batch)
    return batch


def stack(tree, count: int):
    """`count` identical copies along a new leading replica dimension."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (count,) + x.shape), tree)


def take_own(tree):
    """Inside `per_replica`: this replica's copy (the local leading dimension has size 1)."""
    return jax.tree.map(lambda x: x[0], tree)


def as_own(tree):
    return jax.tree.map(lambda x: x[None], tree)



def tree_sq_norm(tree):
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))
