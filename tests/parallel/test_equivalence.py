"""Sync data parallelism equals one device running the global batch, and tensor parallelism equals no sharding.

Tolerance: float32, 5 SGD steps; parallel runs reduce in a different order than one device, so parameters agree to
ATOL=2e-5 / RTOL=2e-5 and losses to 1e-5 relative (observed differences are ~1e-6).
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from tests.helpers import batch_for, trainer_for

MESHES = ("1x1", "8x1", "2x4", "1x8", "data=2,fsdp=2,model=2", "fsdp=8", "data=2,fsdp=4")
ATOL = RTOL = 2e-5
# The MLP covers every mesh. The transformer (the slowest to compile with the CNN) every mesh with tensor
# parallelism or FSDP; the CNN is here for synchronised BatchNorm: statistics over the data axis, over fsdp (the
# batch is split over it too), and with its channels split over the model axis.
MESHES_OF = {"mlp": MESHES[1:], "transformer": ("2x4", "1x8", "data=2,fsdp=2,model=2", "fsdp=8"),
             "cnn": ("8x1", "2x4", "fsdp=8")}


def run(model, mesh, steps=5, dropout=0.0):
    trainer = trainer_for(model, mesh, dropout=dropout)
    state = trainer.init(seed=3)
    losses = []
    for step in range(steps):
        state, metrics = trainer.step(state, batch_for(model, size=16, seed=step % 2))
        losses.append(float(metrics["loss"]))
    return trainer.params(state), np.array(losses)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "cnn", "transformer"])
def test_same_seed_and_batch_give_the_same_training_on_every_mesh(model):
    """Data, FSDP and tensor parallelism and their mixes: the CNN with synchronised BatchNorm, the transformer with
    dropout on."""
    dropout = 0.1 if model == "transformer" else 0.0  # dropout masks are mesh independent too
    reference_params, reference_losses = run(model, "1x1", dropout=dropout)
    assert reference_losses[4] < reference_losses[0]  # it trains (steps 0, 2, 4 see the same batch)
    for mesh in MESHES_OF[model]:
        params, losses = run(model, mesh, dropout=dropout)
        np.testing.assert_allclose(losses, reference_losses, rtol=1e-5, err_msg=mesh)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=ATOL, rtol=RTOL, err_msg=mesh),
                     params, reference_params)


@pytest.mark.slow
def test_initial_parameters_are_identical_on_every_mesh():
    reference = trainer_for("transformer", "1x1").params(trainer_for("transformer", "1x1").init(7))
    for mesh in ("2x4", "1x8"):
        trainer = trainer_for("transformer", mesh)
        jax.tree.map(np.testing.assert_array_equal, trainer.params(trainer.init(7)), reference)
    other_seed = trainer_for("transformer", "1x1").params(trainer_for("transformer", "1x1").init(8))
    assert not np.allclose(other_seed["head"]["kernel"], reference["head"]["kernel"])


class Dropper(nnx.Module):
    def __init__(self, rngs):
        self.scale = nnx.Param(np.ones((64,), np.float32))
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(x * self.scale)


def masks(mesh):
    def loss_fn(model, batch):
        out = model(batch["x"])
        return out.sum(), {"kept": out != 0}

    trainer = jaxpar.Trainer(Dropper, loss_fn, optax.sgd(0.0), jaxpar.make_mesh(mesh))
    state, metrics = trainer.step(trainer.init(0), {"x": np.ones((8, 64), np.float32)})
    return np.asarray(metrics["kept"])


def test_dropout_masks_differ_across_data_shards_and_match_across_meshes():
    kept = masks("8x1")  # 8 data shards, one identical example each
    assert len({row.tobytes() for row in kept}) == 8  # no two shards drew the same mask
    assert 0.3 < kept.mean() < 0.7
    np.testing.assert_array_equal(kept, masks("1x1"))
    np.testing.assert_array_equal(kept, masks("2x4"))
