"""`jaxpar.explain` on a seq mesh: the bytes attention sends over seq in the compiled step equal theory within 2%
(allgather 4 (S-1) b E, ring 4 (S-1) b E + 8 b E zig-zag, Ulysses 8 (S-1)/S b E), and the gradients' sum over seq
equals 2 (S-1)/S x the gradient's bytes within 2%; nothing over seq is flagged unexpected. With stages, the theory
counts every tick's layers and the backward's recompute (GPipe, 1F1B on stage=2,seq=2)."""

import numpy as np
import optax
import pytest

import jaxpar
import models
from jaxpar.cli import Config
from jaxpar.cost import context_traffic

CONFIG = Config(model="transformer", layers=2, d_model=32, heads=8, d_ff=64, seq_len=32, vocab=256, dropout=0.0)


@pytest.mark.parametrize("algorithm", ["ring", pytest.param("allgather", marks=pytest.mark.slow),
                                       pytest.param("ulysses", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_seq_traffic_equals_theory(algorithm):
    trainer = jaxpar.Trainer(model=models.factory(CONFIG), loss_fn=models.LOSSES["transformer"],
                             optimizer=optax.sgd(0.1), mesh=jaxpar.make_mesh("seq=4"), context_parallel=algorithm)
    report = jaxpar.explain(trainer, {"tokens": np.zeros((8, 33), np.int32)})
    variant = report["variants"]["sync"]
    c = variant["context"]
    assert c["algorithm"] == algorithm and c["ways"] == 4 and c["runs"] == 2
    assert c["bytes"] == pytest.approx(c["theory"], rel=0.02)
    assert c["gradient_sum"] == pytest.approx(c["gradient_sum_theory"], rel=0.02)
    kinds = {"allgather": {"all-gather", "reduce-scatter"}, "ring": {"collective-permute"}, "ulysses": {"all-to-all"}}
    assert kinds[algorithm] <= set(c["by_kind"])
    assert variant["unexpected"] == 0
    text = "\n".join(context_traffic.lines(c))
    assert f"context parallel {algorithm} over seq=4" in text and "measured / theory" in text


@pytest.mark.slow
@pytest.mark.parametrize("schedule, algorithm, kind", [("gpipe", "ring", None), ("1f1b", "ring", "collective-permute")])
def test_pipelined_seq_traffic_equals_theory(schedule, algorithm, kind):
    """On stage=2,seq=2 with 2 microbatches: a device's layers run on every tick (1F1B: both sides of every
    half-step); 1F1B's part before the stack and head add their token shift, so only the algorithm's own kind is
    compared there."""
    trainer = jaxpar.Trainer(model=models.factory(CONFIG), loss_fn=models.LOSSES["transformer"],
                             optimizer=optax.sgd(0.1), mesh=jaxpar.make_mesh("stage=2,seq=2"),
                             context_parallel=algorithm, pipeline=jaxpar.Pipeline(schedule, 2))
    variant = jaxpar.explain(trainer, {"tokens": np.zeros((8, 33), np.int32)})["variants"]["sync"]
    c = variant["context"]
    assert c["runs"] == 2 and ("half-steps" if schedule == "1f1b" else "ticks") in c["what"]
    assert (c["by_kind"][kind] if kind else c["bytes"]) == pytest.approx(c["theory"], rel=0.02)
    assert variant["unexpected"] == 0
