"""The explicit strategies on an fsdp x model mesh compute each replica's slice once across its devices: FLOPs per
device as Sync()'s (from the compiled step's cost analysis), the same training as Sync(), and a dropout mask of its
own on every device. Tolerances: FLOPs within 1% of Sync()'s (the replica averaging adds a little arithmetic:
+0.12% for Sync('psum') and +0.08% for LocalSGD's local step on this model, measured; the replicated slice it replaces
was +8.45%); float32 losses rtol 1e-5 and parameters atol 2e-5 after 3 steps (summation order)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.cost.hlo import loop_flops
from jaxpar.runtime.resources import step_flops
from tests.helpers import batch_for, trainer_for

MESH = "data=2,fsdp=2,model=2"


def flops_per_device(strategy, variant, rows=128):
    trainer = trainer_for("transformer", MESH, strategy=strategy)
    compiled = trainer.compiled_step(variant, batch_for("transformer", size=rows))
    return loop_flops(compiled, step_flops(compiled)).per_device


def test_explicit_strategies_do_sync_flops_per_device_on_an_fsdp_x_model_mesh():
    sync = flops_per_device(jaxpar.Sync(), "sync")
    for strategy, variant in ((jaxpar.Sync("psum"), "sync"), (jaxpar.LocalSGD(period=2), "local")):
        assert flops_per_device(strategy, variant) == pytest.approx(sync, rel=0.01), (strategy, variant)


def train(strategy, steps=3, dropout=0.0, grad_accum=1):
    trainer = trainer_for("transformer", MESH, strategy=strategy, dropout=dropout, grad_accum=grad_accum)
    state, losses = trainer.init(0), []
    for step in range(steps):
        state, metrics = trainer.step(state, batch_for("transformer", size=16, seed=step))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(trainer.params(state))


@pytest.mark.slow
@pytest.mark.parametrize("strategy, grad_accum", [(jaxpar.Sync("ring"), 1), (jaxpar.LocalSGD(period=1), 1),
                                                  (jaxpar.Sync("psum"), 2), (jaxpar.Sync("psum"), 8)],
                         ids=["ring", "local_sgd_H1", "accum2", "accum8_replicated_slice"])
def test_the_transformer_trains_as_under_sync_with_rows_split_over_fsdp(strategy, grad_accum):
    """The transformer's embedding lookup, its gradient and the cross-entropy's gather are what crashed XLA's
    partitioner with the rows split over fsdp by the compiler. With 2 microbatches each device accumulates over its
    own rows (4 per device: 2 of them per microbatch); 8 microbatches do not divide a device's 4 rows, so the
    replica's 8 rows stay replicated over its devices (the old formulation) and still train as under Sync()."""
    reference_losses, reference = train(jaxpar.Sync())
    losses, params = train(strategy, grad_accum=grad_accum)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=2e-5, rtol=2e-5), params, reference)


class MaskProbe(nnx.Module):
    """Row r of the batch (its row id) touches only weight row r, through a dropout mask of its own: after one SGD
    step, weight row r is nonzero exactly where row r's mask kept a unit."""

    def __init__(self, rngs):
        self.w = nnx.Param(jnp.zeros((16, 64)))
        self.drop = nnx.Dropout(0.5)

    def __call__(self, row_ids, rngs):
        return jnp.sum(self.w[row_ids] * self.drop(jnp.ones((row_ids.shape[0], 64)), rngs=rngs))


def test_every_device_of_a_replica_draws_its_own_dropout_masks():
    trainer = jaxpar.Trainer(MaskProbe, lambda model, batch, rngs: (model(batch["row"], rngs), {}), optax.sgd(1.0),
                             jaxpar.make_mesh(MESH), strategy=jaxpar.Sync("psum"))
    state, _ = trainer.step(trainer.init(0), {"row": np.arange(16, dtype=np.int32)})
    kept = np.asarray(jax.device_get(trainer.params(state))["w"]) != 0
    assert 0.3 < kept.mean() < 0.7  # rate 0.5: every row is in some device's share
    # rows 0-3 and 4-7 are replica 0's two fsdp devices' shares, 8-11 and 12-15 replica 1's: row i of one share and
    # row i of the other would carry the same mask if the devices drew from the same key
    for i in range(4):
        for j in range(i + 4, 16, 4):
            assert not np.array_equal(kept[i], kept[j]), (i, j)


def test_a_batchnorm_model_keeps_each_replicas_whole_slice_for_its_statistics():
    """The CNN's BatchNorm statistics must be over the replica's slice, not over one fsdp device's share of it: on
    data=2,fsdp=2,model=2 it trains exactly as on two devices (data=2 alone), the statistics included."""
    def run(mesh):
        trainer = trainer_for("cnn", mesh, strategy=jaxpar.Sync("psum"))
        state, losses = trainer.init(0), []
        for step in range(3):
            state, metrics = trainer.step(state, batch_for("cnn", size=16, seed=step))
            losses.append(float(metrics["loss"]))
        stats = nnx.to_pure_dict(nnx.filter_state(state.model_state, nnx.BatchStat))
        return losses, jax.device_get((trainer.params(state), stats))

    reference_losses, reference = run("2x1")
    losses, trained = run(MESH)
    assert jax.tree.leaves(trained[1])  # (the model has BatchNorm statistics)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=2e-5, rtol=2e-5), trained, reference)
