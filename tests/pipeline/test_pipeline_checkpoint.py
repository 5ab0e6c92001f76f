"""Checkpoints of a pipelined model move between stage counts: the stacked parameters are the same arrays (a
leading layers dimension) whatever the stage count, so a stage=2 checkpoint restores bit-identically on stage=4,
1x1 and 2x4, and the reverse, and the next step's loss agrees (rtol 1e-6, the mesh-invariance tolerance)."""

import jax
import numpy as np
import optax
import pytest

import jaxpar
from jaxpar.io.checkpoint import Checkpointer
from jaxpar.pipeline import Pipeline
from tests.pipeline.test_pipeline_trainer import Net, batches, loss_fn

PIPELINE = Pipeline("1f1b", 4)


def trainer_on(mesh):
    return jaxpar.Trainer(Net, loss_fn, optax.adam(1e-2), jaxpar.make_mesh(mesh), pipeline=PIPELINE)


def saved(folder, mesh):
    trainer = trainer_on(mesh)
    state = trainer.init(0)
    for batch in batches(2):
        state, _ = trainer.step(state, batch)
    checkpoints = Checkpointer(str(folder))
    checkpoints.save(2, state, trainer.strategy, trainer.num_replicas)
    checkpoints.wait()
    params = trainer.params(state)
    state, metrics = trainer.step(state, batches(3)[2])
    return checkpoints, params, float(metrics["loss"])


def bits_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("source, targets", [("stage=2", ["stage=4", "1x1", "2x4"]),
                                             ("stage=4", ["stage=2"]), ("1x1", ["stage=2"]),
                                             ("2x4", ["stage=2", "data=2,stage=2,model=2"])])
def test_a_checkpoint_moves_between_stage_counts(tmp_path, source, targets):
    checkpoints, params, next_loss = saved(tmp_path, source)
    assert params["blocks"]["layers"]["up"]["kernel"].shape == (4, 16, 32)
    for mesh in targets:
        trainer = trainer_on(mesh)
        state, _, notes = checkpoints.restore(trainer)
        assert notes == [] and int(state.step) == 2
        assert bits_equal(trainer.params(state), params), mesh
        state, metrics = trainer.step(state, batches(3)[2])
        np.testing.assert_allclose(float(metrics["loss"]), next_loss, rtol=1e-6, err_msg=mesh)
