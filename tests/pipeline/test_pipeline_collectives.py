"""A pipelined step averages its gradients over data once per step, as the partitioner does for an unpipelined
step: the compiled step (GPipe, circular, 1F1B on stage meshes with data, and with model) holds exactly one
all-reduce over the data axis, run once, and its bytes are one gradient average: every parameter byte a device
holds, plus the loss and the accuracy (two float32 scalars). Before, each tick's parameter gradients were
all-reduced over data inside the tick loop (every case here fails on that code).

That the averaged gradients are the right ones is checked in tests/pipeline/test_pipeline_trainer.py (equivalence with the
unpipelined stack on 1x1)."""

import math

import jax
import optax
import pytest

import jaxpar
from jaxpar.cost.hlo import collective_ops
from jaxpar.pipeline import Pipeline
from tests.pipeline.test_pipeline_trainer import Net, batches, loss_fn

SCALARS = 2 * 4  # the step's loss and accuracy, averaged in the same all-reduce


def held_bytes(trainer) -> int:
    """Parameter bytes one device holds (its shard of every parameter): one gradient average moves this much."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(trainer.abstract_state().params))


def data_all_reduces(mesh, pipeline, rate=0.0):
    trainer = jaxpar.Trainer(lambda rngs: Net(rngs, 4, rate), loss_fn, optax.sgd(0.1), jaxpar.make_mesh(mesh),
                             pipeline=pipeline)
    ops = collective_ops(trainer.compiled_step("sync", batches(1)[0]), trainer.mesh)
    return [op for op in ops if op.kind == "all-reduce" and "data" in (op.axes or ())], held_bytes(trainer)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, pipeline", [
    ("data=2,stage=2", Pipeline("gpipe", 4)),
    ("data=2,stage=2", Pipeline("1f1b", 4)),
    ("data=2,stage=2", Pipeline("circular", 4, repeats=2)),
    ("data=2,stage=2,model=2", Pipeline("gpipe", 4)),
    ("data=2,stage=2,model=2", Pipeline("1f1b", 4)),
], ids=lambda v: getattr(v, "schedule", v))
def test_gradients_are_averaged_over_data_once_per_step(mesh, pipeline):
    ops, held = data_all_reduces(mesh, pipeline)
    assert [(op.runs, op.loops) for op in ops] == [(1, ())], ops  # one all-reduce, outside every loop
    assert ops[0].bytes == held + SCALARS, (ops[0].bytes, held)


@pytest.mark.slow
def test_with_dropout_the_average_is_still_once_per_step():
    """Dropout is drawn per row (so a stage map manual over data draws the masks of its own rows): no collective
    for it."""
    ops, held = data_all_reduces("data=2,stage=2", Pipeline("1f1b", 4), rate=0.2)
    assert [(op.runs, op.bytes) for op in ops] == [(1, held + SCALARS)], ops
