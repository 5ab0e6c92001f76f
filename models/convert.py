"""Parameters of a model whose blocks were a list (`blocks.0`, `blocks.1`, ...: the transformer before issue 19) in
the stacked layout of `jaxpar.pipeline.Stack` (`blocks.layers`, every array with a leading layers dimension), and
back.

    old = nnx.to_pure_dict(nnx.state(unstacked_model, nnx.Param))       # {"blocks": {0: {...}, 1: {...}}, ...}
    model = models.Transformer(..., block="gpt", rngs=nnx.Rngs(0))      # the same block, stacked
    nnx.update(model, models.convert.stack_blocks(old))

A checkpoint of the unstacked model needs no call: `Checkpointer.restore` stacks its per-layer arrays into the
names the stacked model has (`jaxpar.io.checkpoint.restore.stack_layers`), optimizer state included.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

LAYERS = "layers"  # the attribute of jaxpar.pipeline.Stack that holds the stacked blocks


def _layer_index(key) -> int | None:
    if isinstance(key, int):
        return key
    if isinstance(key, str) and key.isdigit():
        return int(key)
    return None


def _is_block_list(node: Mapping) -> bool:
    """A dict whose keys are exactly 0 .. n-1 (ints or digit strings), n >= 1: a list of blocks."""
    indices = sorted(i for i in map(_layer_index, node) if i is not None)
    return bool(node) and len(indices) == len(node) and indices == list(range(len(node)))


def stack_blocks(tree):
    """`tree` (nested mappings of arrays, e.g. `nnx.to_pure_dict(state)` or a checkpoint's) with every list of
    blocks (a mapping keyed 0 .. n-1) replaced by `{"layers": their arrays stacked on a new leading axis}`.

    The blocks of one list must have the same structure and shapes (identical blocks), else ValueError."""
    if not isinstance(tree, Mapping):
        return tree
    if _is_block_list(tree):
        blocks = [stack_blocks(tree[key]) for key in sorted(tree, key=_layer_index)]
        structures = {jax.tree.structure(b) for b in blocks}
        if len(structures) != 1:
            raise ValueError(f"stack_blocks: the {len(blocks)} blocks differ in structure; only identical blocks "
                             f"stack")
        try:
            return {LAYERS: jax.tree.map(lambda *layers: jnp.stack(layers), *blocks)}
        except (TypeError, ValueError) as error:
            raise ValueError(f"stack_blocks: the blocks' arrays differ in shape ({error})") from None
    return {key: stack_blocks(value) for key, value in tree.items()}


def unstack_blocks(tree):
    """The inverse of `stack_blocks`: every `{"layers": stacked}` becomes `{0: layer 0, 1: layer 1, ...}`."""
    if not isinstance(tree, Mapping):
        return tree
    if set(tree) == {LAYERS} and isinstance(tree[LAYERS], Mapping):
        stacked = tree[LAYERS]
        count = jax.tree.leaves(stacked)[0].shape[0]
        return {i: unstack_blocks(jax.tree.map(lambda a: a[i], stacked)) for i in range(count)}
    return {key: unstack_blocks(value) for key, value in tree.items()}
