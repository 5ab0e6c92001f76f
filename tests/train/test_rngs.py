"""Randomness at call time: `loss_fn(model, batch, rngs)` gets a fresh dropout stream every step, derived from the
run key in the train state; under Sync() the masks are drawn for the global batch, so every mesh trains the same.
Tolerances: float32, losses rtol 1e-5, parameters atol 2e-5."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.train.step import takes_rngs


class CallTimeDropout(nnx.Module):
    """Like Flax's NNX lm1b example: Dropout holds no rngs; the caller passes them."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.hidden = nnx.Linear(16, 32, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")))
        self.dropout = nnx.Dropout(0.5)
        self.out = nnx.Linear(32, 4, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("mlp", None)))

    def __call__(self, x, rngs=None):
        return self.out(self.dropout(jax.nn.relu(self.hidden(x)), rngs=rngs))


def loss_fn(model, batch, rngs):
    logits = model(batch["x"], rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def batch(seed=0, size=16):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(size, 16)).astype(np.float32), "y": rng.integers(0, 4, size).astype(np.int32)}


def train(mesh, steps=4, optimizer=None, strategy=None, same_batch=False, **kw):
    trainer = jaxpar.Trainer(CallTimeDropout, loss_fn, optimizer or optax.sgd(0.1), jaxpar.make_mesh(mesh),
                             strategy=strategy, **kw)
    state, losses = trainer.init(0), []
    for step in range(steps):
        state, metrics = trainer.step(state, batch(0 if same_batch else step))
        losses.append(float(metrics["loss"]))
    return trainer, state, np.array(losses)


def test_loss_fn_forms_are_recognised():
    assert takes_rngs(loss_fn) and takes_rngs(lambda model, batch, rngs: 0) and takes_rngs(lambda m, b, *, rngs: 0)
    assert not takes_rngs(lambda model, batch: 0)
    assert not takes_rngs(lambda model, batch, label_smoothing=0.1: 0)  # a third argument with a default


@pytest.mark.slow
def test_call_time_dropout_is_identical_on_every_mesh():
    trainer, state, reference = train("1x1")
    expected = trainer.params(state)
    for mesh in ("2x4", "data=2,fsdp=2,model=2", "fsdp=8"):
        trainer, state, losses = train(mesh)
        np.testing.assert_allclose(losses, reference, rtol=1e-5, err_msg=mesh)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, err_msg=mesh),
                     trainer.params(state), expected)


def test_masks_are_fresh_every_step_and_follow_the_seed():
    _, _, losses = train("2x4", optimizer=optax.sgd(0.0), same_batch=True)  # same parameters, same batch
    assert len(set(losses.round(6))) == len(losses)  # only the dropout masks change between steps
    _, _, again = train("2x4", optimizer=optax.sgd(0.0), same_batch=True)
    np.testing.assert_array_equal(losses, again)  # and they are a pure function of the seed and the step


def test_no_dropout_in_evaluation():
    trainer, state, _ = train("2x4", steps=1)
    first = float(trainer.evaluate(state, batch(5))["loss"])
    assert float(trainer.evaluate(state, batch(5))["loss"]) == first


@pytest.mark.parametrize("strategy", [jaxpar.Sync("ring"), jaxpar.LocalSGD(period=2), jaxpar.SSP(staleness=1)],
                         ids=["sync_ring", "local_sgd", "ssp"])
def test_explicit_strategies_fold_the_replica_index_into_the_call_time_key(strategy):
    """Each replica draws its own masks: with one identical example per replica the replicas' losses differ."""
    trainer = jaxpar.Trainer(CallTimeDropout, lambda m, b, rngs: (loss_fn(m, b, rngs)[0], {}),
                             optax.sgd(0.0), jaxpar.make_mesh("8x1"), strategy=strategy)
    one = batch(0, size=1)
    same = {k: np.repeat(v, 8, axis=0) for k, v in one.items()}
    _, metrics = trainer.step(trainer.init(0), same)
    loss = np.asarray(metrics["loss"])
    assert np.isfinite(loss).all()
    if loss.ndim:  # local SGD's local step reports each replica's own loss: they differ with the masks
        assert loss.shape == (8,) and len(set(loss.tolist())) == 8
    from jaxpar.train.step import make_rngs
    from jaxpar.strategies import replicas as rep
    from jax.sharding import PartitionSpec as P

    def own(key):  # the key the replica step uses: fold_in(step key, replica index)
        return rep.as_own(jax.random.key_data(jax.random.fold_in(key, rep.replica_index())))

    keys = jax.jit(rep.per_replica(trainer.ctx, own, in_specs=(P(),), out_specs=rep.SHARDED))(jax.random.key(0))
    assert len({bytes(np.asarray(k)) for k in keys}) == 8


@pytest.mark.slow
def test_grad_accum_folds_the_microbatch_index():
    """Microbatch m (rows m, m + 4, ...) draws its masks from fold_in(step key, m): the accumulated step's loss is
    the mean of the four microbatch losses computed by hand with exactly those keys."""
    from jaxpar.train.step import make_rngs

    trainer, state, _ = train("2x4", steps=0, grad_accum=4)
    full = batch(3)
    for step in range(2):
        model = nnx.merge(trainer.ctx.graphdef, state.params, state.model_state)
        key = jax.random.fold_in(jax.random.wrap_key_data(state.key), step)  # the step key
        by_hand = [float(loss_fn(model, {k: v[m::4] for k, v in full.items()}, make_rngs(jax.random.fold_in(key, m)))[0])
                   for m in range(4)]
        unfolded = [float(loss_fn(model, {k: v[m::4] for k, v in full.items()}, make_rngs(key))[0]) for m in range(4)]
        state, metrics = trainer.step(state, full)
        np.testing.assert_allclose(float(metrics["loss"]), np.mean(by_hand), rtol=1e-5)
        assert abs(np.mean(unfolded) - np.mean(by_hand)) > 1e-3  # the fold matters: one key for all would differ


class OwnedDropout(CallTimeDropout):
    """The same layers, but Dropout holds the model's own rngs (a stream in the model state) and the loss takes no
    rngs: the form of models written before call-time rngs."""

    def __init__(self, rngs):
        super().__init__(rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(jax.nn.relu(self.hidden(x))))


def owned_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean(), {}


def test_models_that_own_their_rngs_keep_working():
    """A model whose Dropout owns its rngs draws on data=2,fsdp=2,model=2 exactly the masks it draws on one device
    (its stream lives in the model state and is drawn for the global batch), and its stream advances every step:
    with lr 0 and one batch the losses differ only by the masks, and they are the same on both meshes."""
    runs = {}
    for mesh in ("1x1", "data=2,fsdp=2,model=2"):
        trainer = jaxpar.Trainer(OwnedDropout, owned_loss, optax.sgd(0.0), jaxpar.make_mesh(mesh))
        state, losses = trainer.init(0), []
        for _ in range(3):
            state, metrics = trainer.step(state, batch(0))
            losses.append(float(metrics["loss"]))
        runs[mesh] = losses
    np.testing.assert_allclose(runs["data=2,fsdp=2,model=2"], runs["1x1"], rtol=1e-5)
    assert len(set(np.round(runs["1x1"], 6))) == 3
