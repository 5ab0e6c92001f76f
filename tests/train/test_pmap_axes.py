"""Models written for pmap (`nn.BatchNorm(axis_name='batch')`, `lax.pmean(x, 'batch')`) train unchanged with
`batch_axis_names=('batch',)`: under `Sync()` the statistics are the global batch's (equal to the same model without
the axis name on one device), under local SGD each replica's own; without the argument, one `ModelError` line.
Tolerances: float32, rtol 1e-5 on losses, atol 2e-5 on parameters and statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxpar
from jaxpar.errors import ConfigError, FitError, ModelError

BATCH_AXIS = "batch"  # the pmap-era name the models below use


class LinenBN(nn.Module):
    """In the style of Flax's ImageNet ResNet: BatchNorm synced over a pmap axis, a `train` argument."""
    axis_name: str | None = BATCH_AXIS

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5, axis_name=self.axis_name)(x)
        return nn.Dense(3)(nn.relu(x))


class NnxPmean(nnx.Module):
    """An NNX model centring its activations with the batch mean, synced by hand as under pmap."""

    def __init__(self, rngs, axis_name: str | None = BATCH_AXIS):
        self.dense, self.out, self.axis_name = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs), axis_name

    def __call__(self, x):
        h = self.dense(x)
        mean = h.mean(0) if self.axis_name is None else jax.lax.pmean(h.mean(0), self.axis_name)
        return self.out(nnx.relu(h - mean))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}


def batch(seed):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=(16, 3)).astype(np.float32)}


def factory(kind, axis_name, **kw):
    if kind == "linen":
        return jaxpar.from_linen(LinenBN(axis_name=axis_name), jnp.zeros((1, 8)), **kw)
    return lambda rngs: NnxPmean(rngs, axis_name)


def run(kind, mesh, axis_name=BATCH_AXIS, steps=3, bound_by="Trainer", **kw):
    """`bound_by`: which argument binds the axis name, Trainer's or from_linen's."""
    names = (BATCH_AXIS,) if axis_name else ()
    model = factory(kind, axis_name, **({"batch_axis_names": names} if bound_by == "from_linen" else {}))
    trainer = jaxpar.Trainer(model, loss_fn, optax.sgd(0.1), jaxpar.make_mesh(mesh),
                             batch_axis_names=names if bound_by == "Trainer" else (), **kw)
    state, losses = trainer.init(0), []
    for step in range(steps):
        state, metrics = trainer.step(state, batch(step))
        losses.append(float(metrics["loss"]))
    evaluated = float(trainer.evaluate(state, batch(9))["loss"])
    batch_stats = jax.device_get(nnx.to_pure_dict(nnx.filter_state(state.model_state, nnx.BatchStat)))
    return losses, trainer.params(state), batch_stats, evaluated


def assert_close_trees(a, b, atol=2e-5):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=atol), a, b)


@pytest.fixture(scope="module")
def single_device():
    """The same models without any axis name, on one device: the whole batch's statistics by construction."""
    return {kind: run(kind, "1x1", axis_name=None) for kind in ("linen", "nnx")}


@pytest.mark.parametrize("kind, mesh, bound_by", [
    ("linen", "8", "Trainer"), ("linen", "data=2,fsdp=2,model=2", "Trainer"), ("linen", "8", "from_linen"),
    ("nnx", "8", "Trainer"), ("nnx", "data=2,fsdp=2,model=2", "Trainer")])
def test_bound_axis_sees_the_global_batch(kind, mesh, bound_by, single_device):
    losses, params, batch_stats, evaluated = run(kind, mesh, bound_by=bound_by)
    ref_losses, ref_params, ref_state, ref_evaluated = single_device[kind]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_close_trees(params, ref_params)
    assert_close_trees(batch_stats, ref_state)  # the BatchNorm running statistics
    assert (kind == "nnx") == (not jax.tree.leaves(batch_stats))  # (the Linen model has some)
    assert evaluated == pytest.approx(ref_evaluated, rel=1e-5)


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_unbound_axis_is_one_model_error_naming_it_and_the_argument(kind):
    trainer = jaxpar.Trainer(factory(kind, BATCH_AXIS), loss_fn, optax.sgd(0.1), jaxpar.make_mesh("8"))
    with pytest.raises(ModelError) as info:
        trainer.step(trainer.init(0), batch(0))
    message = str(info.value)
    assert "\n" not in message and "'batch'" in message and "batch_axis_names=('batch',)" in message, message
    assert message.startswith("step 0, batch {x: (16, 8) float32, y: (16, 3) float32}: "), message
    assert isinstance(info.value.__cause__, NameError)
    with pytest.raises(FitError, match=r"batch_axis_names=\('batch',\)") as info:
        trainer.fit(trainer.init(0), iter([batch(0)]), steps=1)
    assert isinstance(info.value.__cause__, NameError) and info.value.state is not None


def test_local_sgd_replicas_use_their_own_statistics():
    """Under LocalSGD each replica is its own batch: after a local step, replica r's BatchNorm statistics are those
    of its own slice (rows 2r, 2r + 1 of 16 on 8 replicas), computed here by Linen on that slice alone."""
    trainer = jaxpar.Trainer(factory("linen", BATCH_AXIS), loss_fn, optax.sgd(0.1), jaxpar.make_mesh("8"),
                             batch_axis_names=(BATCH_AXIS,), strategy=jaxpar.LocalSGD(period=2))
    state = trainer.init(0)
    params = trainer.params(state)["linen"]
    state, metrics = trainer.step(state, batch(0))
    assert np.isfinite(float(metrics["loss"]))
    stats = jax.device_get(nnx.to_pure_dict(state.strategy_state["model_state"]))["linen"]["BatchNorm_0"]
    x = batch(0)["x"]
    for replica in range(8):
        _, updated = LinenBN(axis_name=None).apply({"params": params, "batch_stats": {"BatchNorm_0": {
            "mean": np.zeros(16, np.float32), "var": np.ones(16, np.float32)}}}, x[2 * replica:2 * replica + 2],
            mutable=["batch_stats"])
        for name in ("mean", "var"):
            np.testing.assert_allclose(stats[name][replica], updated["batch_stats"]["BatchNorm_0"][name], atol=2e-5)
    assert not np.allclose(stats["mean"][0], stats["mean"][1], atol=1e-3)  # the replicas' statistics differ


def test_batch_axis_names_are_checked():
    with pytest.raises(ConfigError, match=r"^batch_axis_names=\('data',\): 'data' is an axis of jaxpar's mesh"):
        jaxpar.Trainer(factory("nnx", BATCH_AXIS), loss_fn, optax.sgd(0.1), jaxpar.make_mesh("8"),
                       batch_axis_names=("data",))
    with pytest.raises(ConfigError, match=r"^batch_axis_names: got \(3,\); pass a tuple"):
        jaxpar.from_linen(LinenBN(), jnp.zeros((1, 8)), batch_axis_names=(3,))
