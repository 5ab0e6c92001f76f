"""`Stack`: a stack of identical blocks with one leading `layers` dimension, that a mesh's stage axis splits.

    class MyModel(nnx.Module):
        def __init__(self, rngs):
            self.embed = ...
            self.blocks = jaxpar.pipeline.Stack(lambda rngs: MyBlock(..., rngs=rngs), 8, rngs=rngs)
            self.head = ...

        def __call__(self, x, rngs=None):
            return self.head(self.blocks(self.embed(x), rngs=rngs))

The blocks are built with `nnx.vmap`: every parameter gets a leading dimension of `num_layers` and the logical
name `layers` first (the default rules put `layers` on the stage axis); inside a block the parameters keep their own
names (fsdp / model). A block is `block(x, *args)`, or `block(x, *args, rngs=rngs)` when the stack is called with
`rngs`, returning an array shaped like `x`; `args` are the same for every layer and every microbatch (positions, a
causal mask), never per example.

The blocks' parameters without logical names get `layers` on their leading dimension alone (the rest unnamed), so
a stack of plain blocks (`nnx.Linear` without partitioning) splits over stages too.

How a call runs, from the `LayerRun` the trainer binds to the stack (`bind`: its mesh, `Pipeline` and remat policy,
`jaxpar.pipeline.layer_run`):
- no stage axis and one microbatch (or outside a trainer): a `lax.scan` over the layers;
- no stage axis and M microbatches: each microbatch through that scan in turn (so dropout draws the same masks as
  on a stage mesh);
- a stage axis of S > 1: the schedule (`gpipe`, `circular`) in a `shard_map` manual over the stage axis; stage s
  runs its contiguous run of layers. 1F1B's training step is built around the stack by `jaxpar.pipeline.split`;
  its evaluation runs the GPipe forward.

Dropout: a stack called with `rngs` draws one key from `rngs.dropout` and gives layer l of microbatch m the
streams of `fold_in(fold_in(key, m), l)`: the same masks on every mesh and stage count for the same microbatch
count. Blocks may keep other state (e.g. their own RNG streams) only when nothing is pipelined or microbatched.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxpar.checks import check_int
from jaxpar.errors import ModelError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd
from jaxpar.pipeline import shard_keys
from jaxpar.pipeline.layer_run import ALONE, LayerRun
from jaxpar.pipeline.schedules import circular

LAYERS = "layers"  # the logical name of a stack's leading dimension (rules: layers -> the stage axis)


def split_microbatches(x: jax.Array, count: int) -> jax.Array:
    """[B, ...] -> [M, B / M, ...]: microbatch m holds rows m, m + M, ... (each keeps its share of every data
    shard, as gradient accumulation does)."""
    return x.reshape((x.shape[0] // count, count) + x.shape[1:]).swapaxes(0, 1)


def merge_microbatches(xs: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`."""
    return xs.swapaxes(0, 1).reshape((xs.shape[0] * xs.shape[1],) + xs.shape[2:])


def layer_rngs(key, microbatch, layer, shard=None) -> nnx.Rngs:
    """`shard`: (first row, rows) of this device's rows of the microbatch, inside a stage map manual over data: its
    draws are then the whole microbatch's at those rows (`jaxpar.pipeline.shard_keys`)."""
    k = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(key), microbatch), layer)
    if shard is not None:
        k = shard_keys.shard_key(k, *shard)
    return nnx.Rngs(jax.random.fold_in(k, 0), dropout=jax.random.fold_in(k, 1))


class Stack(nnx.Module):
    """`num_layers` blocks `block(rngs)` stacked on a leading `layers` dimension; see the module docstring."""

    def __init__(self, block: Callable[[nnx.Rngs], nnx.Module], num_layers: int, *, rngs: nnx.Rngs):
        check_int("Stack(num_layers=...)", num_layers, 1, "blocks in the stack", error=ModelError)
        if isinstance(block, nnx.Module) or not callable(block):
            raise ModelError(f"Stack(block={type(block).__name__}): pass a function rngs -> nnx.Module (e.g. "
                             f"lambda rngs: MyBlock(..., rngs=rngs)), not a built module")

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
        def create(rngs):
            return block(rngs)

        self.layers = create(rngs)
        self.num_layers = num_layers
        _name_layers(self.layers)

    run: LayerRun = ALONE  # how the layers run (`bind`); a class default, so an unbound model's graph is unchanged
    tap = None  # 1F1B's split of the loss (`jaxpar.pipeline.split`): `tap(stack, x, args, key)` replaces the layers

    # --- one chunk of layers ---------------------------------------------------------------------------------------
    def _chunk(self, graphdef, args, key, remat=None, shard=None):
        """`run(params, rest, x, m, first) -> (y, rest)`: the layers of `params` (leading dimension k) in order on
        `x`, microbatch `m`, the first being global layer `first`. `remat`: a `jax.checkpoint_policies` policy each
        layer runs under (its backward keeps only what the policy saves), or None. `shard`: see `layer_rngs`."""
        def layer(h, p, r, m, index):
            block = nnx.merge(graphdef, p, r)
            if key is None:
                out = block(h, *args)
            else:
                out = block(h, *args, rngs=layer_rngs(key, m, index, shard))
            if not (hasattr(out, "shape") and out.shape == h.shape):
                raise ModelError(f"jaxpar.pipeline.Stack: a block returned {getattr(out, 'shape', type(out))} "
                                 f"for an input of shape {h.shape}; a stacked block must return an array shaped "
                                 f"like its input")
            return out.astype(h.dtype), nnx.split(block, nnx.Param, ...)[2]

        if remat is not None:
            layer = jax.checkpoint(layer, policy=remat)

        def run(params, rest, x, m, first):
            def body(h, inputs):
                j, p, r = inputs
                return layer(h, p, r, m, first + j)

            count = jax.tree.leaves(params)[0].shape[0]
            return lax.scan(body, x, (jnp.arange(count), params, rest))

        return run

    def __call__(self, x: jax.Array, *args, rngs: nnx.Rngs | None = None) -> jax.Array:
        key = None if rngs is None else jax.random.key_data(rngs.dropout())
        if self.tap is not None:
            return self.tap(self, x, args, key)
        run = self.run
        graphdef, params, rest = nnx.split(self.layers, nnx.Param, ...)
        chunk = self._chunk(graphdef, args, key, run.remat)
        stages, pipeline = run.stages, run.pipeline
        count = pipeline.microbatches
        if stages == 1 and count == 1:
            y, rest = chunk(params, rest, x, 0, 0)
            nnx.update(self.layers, rest)
            return y
        self._check_stateless(rest, stages)
        shards = 1 if stages == 1 else shd.stage_row_shards(run.mesh)
        pipeline.check_microbatches(x.shape[0], stages, "the batch reaching jaxpar.pipeline.Stack", shards)
        xs = split_microbatches(x, count)
        if stages == 1:
            ys = lax.map(lambda mx: chunk(params, rest, mx[1], mx[0], 0)[0], (jnp.arange(count), xs))
            return merge_microbatches(ys)
        return merge_microbatches(self._pipelined(run, stages, params, rest, xs, args, key))

    def _check_stateless(self, rest, stages: int) -> None:
        if jax.tree.leaves(rest):
            path = next(iter(nnx.to_flat_state(rest)))[0]
            where = f"stage={stages}" if stages > 1 else "more than one microbatch"
            raise ModelError(f"jaxpar.pipeline.Stack with {where}: block state {'.'.join(map(str, path))!r} is not "
                             f"an nnx.Param (RNG streams or statistics kept in a block cannot follow microbatches "
                             f"through stages); build the block's Dropout without rngs and pass rngs at call time "
                             f"(stack(x, rngs=rngs))")

    def by_stage(self, params, stages: int, rounds: int):
        """The layers' parameters `[L, ...]` as `[S, R, L / (S R), ...]`: stage s's chunk r is the (r S + s)-th run of
        layers (the leading dimension goes over the stage axis)."""
        per = self.num_layers // (stages * rounds)
        return jax.tree.map(lambda a: a.reshape((rounds, stages, per) + a.shape[1:]).swapaxes(0, 1), params)

    def _pipelined(self, run: LayerRun, stages: int, params, rest, xs, args, key):
        """GPipe / circular over the stage axis (1F1B evaluates with GPipe's forward)."""
        mesh, pipeline, remat = run.mesh, run.pipeline, run.remat
        rounds = pipeline.rounds
        pipeline.check_layers(self.num_layers, stages, "jaxpar.pipeline.Stack")
        per = self.num_layers // (stages * rounds)
        by_stage = self.by_stage(params, stages, rounds)
        axis = mesh_lib.STAGE_AXIS

        rows_axis = shd.stage_rows_axis(mesh)

        def body(p, xs, args, key):
            p = jax.tree.map(lambda a: a[0], p)  # this stage's [R, k, ...]
            stage = lax.axis_index(axis)
            shard = None if rows_axis is None else (lax.axis_index(rows_axis) * xs.shape[1], xs.shape[1])
            inner = self._chunk(nnx.split(self.layers, nnx.Param, ...)[0], args, key, remat, shard)

            def stage_fn(chunk, x, m, r):
                return inner(chunk, rest, x, m, (r * stages + stage) * per)[0]

            return circular(stage_fn, p, xs, axis=axis, repeats=rounds)[None]

        # each data shard runs its own rows of every microbatch (so gradients are averaged over data once per step)
        mapped = shd.over_stages(body, mesh, (shd.STAGE_SPLIT, shd.stage_rows(mesh, 1), shd.REPLICATED,
                                              shd.REPLICATED), shd.stage_rows(mesh, 2, staged=True))
        return mapped(by_stage, xs, args, key)[-1]


def _name_layers(layers) -> None:
    """`layers` on the leading dimension of each stacked parameter that has no logical names (`nnx.vmap` adds it only
    to names a block gave)."""
    for _, variable in nnx.iter_graph(layers):
        rank = len(getattr(variable.get_value(), "shape", ())) if isinstance(variable, nnx.Param) else 0
        if rank and not shd.logical_names_of(variable):
            variable.set_metadata(out_sharding=(LAYERS,) + (None,) * (rank - 1))


def stacks(model: nnx.Module) -> list[Stack]:
    """The model's Stacks, in graph order."""
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, Stack)]


def bind(model: nnx.Module, run: LayerRun) -> bool:
    """Sets `run` on every Stack of `model` (an abstract model, before the trainer takes its graphdef); whether it
    has one."""
    found = stacks(model)
    for stack in found:
        stack.run = run
    return bool(found)


def splits_loss(model: nnx.Module) -> bool:
    """Whether `model`'s training step is 1F1B's split of the loss: a Stack bound to 1F1B on a stage mesh."""
    return any(stack.run.splits_loss for stack in stacks(model))
