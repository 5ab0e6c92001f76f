"""Rematerialization (`Trainer(remat=...)`, `--remat`): every policy gives the same losses and parameters as no remat
(the same math, recomputed), per layer in the built-in transformer's stack, over the whole forward of a user's NNX
model, in a GPipe pipeline and under LocalSGD; `full` keeps fewer temporaries and does more FLOPs; a bad value is
one error line.

Tolerances: float32, the same operations in a different order at most: rtol 1e-6 / atol 1e-6, with SGD (Adam would
magnify the last-bit differences of near-zero gradients into 1e-5 parameter changes)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
import models
import run
from jaxpar.cli import Config
from jaxpar.pipeline import Pipeline
from jaxpar.runtime.resources import step_flops
from jaxpar.train.remat import REMATS
from tests.helpers import TINY, batch_for

RTOL = ATOL = 1e-6
POLICIES = [r for r in REMATS if r != "none"]


class MLP(nnx.Module):
    """A user's model: no Stack, dropout from call-time rngs (so remat recomputes the same masks)."""

    def __init__(self, rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.down = nnx.Linear(32, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.2)

    def __call__(self, x, rngs=None):
        return self.down(self.drop(jax.nn.gelu(self.up(x)), rngs=rngs))


def mlp_loss(model, batch, rngs):
    logits = model(batch["x"], rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def mlp_batches(count=3, size=16):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(size, 8)).astype(np.float32), "y": rng.integers(0, 4, size).astype(np.int32)}
            for _ in range(count)]


def transformer(remat, mesh="1x1", **kw):
    return jaxpar.Trainer(model=models.factory(TINY["transformer"].replace(dropout=0.1, layers=2, heads=2)),
                          loss_fn=models.LOSSES["transformer"], optimizer=optax.sgd(0.1),
                          mesh=jaxpar.make_mesh(mesh), remat=remat, **kw)


def mlp(remat, mesh="1x1", **kw):
    return jaxpar.Trainer(MLP, mlp_loss, optax.sgd(0.1), jaxpar.make_mesh(mesh), remat=remat, **kw)


def train(trainer, batches):
    state, losses = trainer.init(0), []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), trainer.params(state)


MODELS = {"transformer": (transformer, lambda: [batch_for("transformer", 16, seed) for seed in range(3)]),
          "mlp": (mlp, mlp_batches)}
_REFERENCE = {}


def reference(model, mesh="1x1", **kw):
    key = (model, mesh, tuple(sorted((k, repr(v)) for k, v in kw.items())))
    if key not in _REFERENCE:
        make, batches = MODELS[model]
        _REFERENCE[key] = train(make("none", mesh, **kw), batches())
    return _REFERENCE[key]


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), got[1], want[1])


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("remat", POLICIES)
def test_every_policy_trains_like_no_remat(model, remat):
    make, batches = MODELS[model]
    assert_same(train(make(remat), batches()), reference(model))


def test_a_jax_checkpoint_policy_callable_is_accepted():
    assert_same(train(mlp(jax.checkpoint_policies.dots_saveable), mlp_batches()), reference("mlp"))


@pytest.mark.slow
def test_remat_works_in_a_gpipe_pipeline():
    pipeline = Pipeline("gpipe", 2)
    got = train(transformer("full", "stage=2", pipeline=pipeline), MODELS["transformer"][1]())
    assert_same(got, reference("transformer", "stage=2", pipeline=pipeline))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.slow
def test_remat_works_under_local_sgd(model):
    make, batches = MODELS[model]
    strategy = jaxpar.LocalSGD(period=8)  # 3 local steps: one step variant to compile
    assert_same(train(make("dots", "data=2", strategy=strategy), batches()),
                reference(model, "data=2", strategy=strategy))


@pytest.mark.slow
def test_full_remat_keeps_fewer_temporaries_and_does_more_flops():
    """Measured on this model (4 layers, d_model 64, seq_len 64, batch 16, 1 device): temporaries none 57.3 MB,
    full 17.4 MB (0.30x); FLOPs 0.573 G against 0.694 G (1.21x: the forward of the blocks once more)."""
    config = Config(model="transformer", layers=4, d_model=64, heads=4, d_ff=256, seq_len=64, vocab=256, dropout=0.0)
    batch = {"tokens": np.zeros((16, 65), np.int32)}
    measured = {}
    for remat in ("none", "full"):
        trainer = jaxpar.Trainer(model=models.factory(config), loss_fn=models.LOSSES["transformer"],
                                 optimizer=optax.sgd(0.1), mesh=jaxpar.make_mesh("1x1"), remat=remat)
        compiled = trainer.compiled_step("sync", batch)
        measured[remat] = compiled.memory_analysis().temp_size_in_bytes, step_flops(compiled)
    (temp_none, flops_none), (temp_full, flops_full) = measured["none"], measured["full"]
    assert temp_full <= 0.4 * temp_none, measured
    assert flops_full >= 1.1 * flops_none, measured


@pytest.mark.parametrize("bad", ["bogus", "Full", 3])
def test_a_bad_remat_is_one_config_error_naming_it(bad):
    with pytest.raises(jaxpar.ConfigError, match=r"^remat .*: choose one of none, full, dots, dots-no-batch"):
        mlp(bad)


def test_a_bad_remat_flag_is_one_line_and_exit_code_2(capsys):
    assert run.main(["--remat", "everything", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--remat 'everything'" in err and "dots-no-batch" in err and len(err.splitlines()) == 1, err
