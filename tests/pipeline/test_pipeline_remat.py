"""Rematerialization in the pipeline schedules (`Trainer(remat=...)`, `--remat`): 1F1B with remat trains exactly as
1F1B without (its per-tick `jax.vjp` recomputes the stage forward from the stash; remat applies per layer inside it),
and both 1F1B and GPipe keep fewer temporaries under `full`.

Tolerances: float32, the same operations in a different order at most: rtol 1e-6 / atol 1e-6 (SGD, as
tests/train/test_remat.py)."""

import numpy as np
import optax
import pytest

import jaxpar
import models
from jaxpar.cli import Config
from jaxpar.pipeline import Pipeline
from tests.helpers import TINY, batch_for
from tests.train.test_remat import assert_same, train


def transformer(remat, mesh, pipeline, config=None):
    config = config or TINY["transformer"].replace(dropout=0.1, layers=2, heads=2)
    return jaxpar.Trainer(model=models.factory(config), loss_fn=models.LOSSES["transformer"],
                          optimizer=optax.sgd(0.1), mesh=jaxpar.make_mesh(mesh), remat=remat, pipeline=pipeline)


@pytest.mark.slow
def test_1f1b_with_remat_trains_like_1f1b_without():
    pipeline, batches = Pipeline("1f1b", 4), [batch_for("transformer", 16, seed) for seed in range(3)]
    assert_same(train(transformer("full", "data=2,stage=2", pipeline), batches),
                train(transformer("none", "data=2,stage=2", pipeline), batches))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_full_remat_shrinks_the_pipelined_steps_temporaries(schedule):
    """Measured (stage=2, M=4, 4 layers of d_model 64, d_ff 256, seq_len 64, batch 16; compiled temporaries per
    device): 1F1B none 10,694,600 B, full 6,105,688 B (0.57x); GPipe none 10,542,792 B, full 5,926,648 B (0.56x)."""
    config = Config(model="transformer", layers=4, d_model=64, heads=4, d_ff=256, seq_len=64, vocab=256, dropout=0.0)
    batch = {"tokens": np.zeros((16, 65), np.int32)}
    temps = {remat: transformer(remat, "stage=2", Pipeline(schedule, 4), config).compiled_step("sync", batch)
             .memory_analysis().temp_size_in_bytes for remat in ("none", "full")}
    assert temps["full"] <= 0.7 * temps["none"], temps
