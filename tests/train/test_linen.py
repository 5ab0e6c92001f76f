"""Linen models through `jaxpar.from_linen`: BatchNorm statistics are updated without the user asking for mutable
collections, and `evaluate` is deterministic (running averages, no dropout), also when the switch is part of the
module's configuration. Tolerance: float32, atol 1e-5."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import jaxpar


class Net(nn.Module):
    deterministic: bool = False  # a configuration switch, as in Flax's Linen lm1b

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(32, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
        x = nn.Dropout(0.5, deterministic=self.deterministic or not train)(nn.relu(x))
        return nn.Dense(3)(x)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=(16, 3)).astype(np.float32)}


@pytest.mark.parametrize("how", ["call_kwargs", "config_switch"])
def test_linen_batchnorm_and_dropout_train_and_evaluate_deterministically(how):
    if how == "call_kwargs":
        factory = jaxpar.from_linen(Net(), jnp.zeros((1, 8)), train_kwargs={"train": True},
                                    eval_kwargs={"train": False})
    else:  # the module's own configuration decides; BatchNorm still follows `train`
        factory = jaxpar.from_linen(Net(), jnp.zeros((1, 8)), eval_module=Net(deterministic=True),
                                    eval_kwargs={"train": False})
    trainer = jaxpar.Trainer(factory, loss_fn, optax.sgd(0.1), jaxpar.make_mesh("2x4"))
    state = trainer.init(0)
    for step in range(3):
        state, metrics = trainer.step(state, batch(step))
        assert np.isfinite(float(metrics["loss"]))
    assert trainer.trace_count == 1  # the state keeps its structure: one compilation
    stats = state.model_state["linen"]["BatchNorm_0"]  # Linen's batch_stats collection, by module
    assert float(jnp.abs(stats["mean"].get_value()).sum()) > 0  # running statistics were updated
    # evaluate == the deterministic Linen forward pass with the trained variables and running averages
    params = trainer.params(state)["linen"]
    variables = {"params": params,
                 "batch_stats": jax.tree.map(np.asarray, jax.device_get(
                     {"BatchNorm_0": {k: v.get_value() for k, v in stats.items()}}))}
    held_out = batch(9)
    expected = jnp.mean((Net().apply(variables, held_out["x"], train=False) - held_out["y"]) ** 2)
    got = float(trainer.evaluate(state, held_out)["loss"])
    assert got == pytest.approx(float(expected), abs=1e-5)
    assert float(trainer.evaluate(state, held_out)["loss"]) == got


class Deterministic(nn.Module):
    """A `deterministic` argument without a default, as in many Linen transformers."""

    @nn.compact
    def __call__(self, x, deterministic: bool):
        return nn.Dense(3)(nn.Dropout(0.5, deterministic=deterministic)(nn.relu(nn.Dense(32)(x))))


class Training(nn.Module):
    """A mode argument under another name: nothing to infer."""

    @nn.compact
    def __call__(self, x, training: bool):
        return nn.Dense(3)(nn.Dropout(0.5, deterministic=not training)(x))


def train_and_evaluate(factory, steps=2):
    trainer = jaxpar.Trainer(factory, loss_fn, optax.sgd(0.1), jaxpar.make_mesh("8"))
    state, losses = trainer.init(0), []
    for step in range(steps):
        state, metrics = trainer.step(state, batch(step))
        losses.append(float(metrics["loss"]))
    return trainer, state, losses, float(trainer.evaluate(state, batch(9))["loss"])


def test_train_argument_is_inferred_and_said_in_one_note():
    inferred = jaxpar.from_linen(Net(), jnp.zeros((1, 8)))
    assert (inferred.train_kwargs, inferred.eval_kwargs) == ({"train": True}, {"train": False})
    trainer, _, losses, evaluated = train_and_evaluate(inferred)
    notes = [n for n in trainer.notes if n.startswith("from_linen")]
    assert notes == ["from_linen: Net.__call__ takes train: it is called with train=True in training and "
                     "train=False in evaluation (pass train_kwargs / eval_kwargs to choose otherwise)"]
    explicit = jaxpar.from_linen(Net(), jnp.zeros((1, 8)), train_kwargs={"train": True}, eval_kwargs={"train": False})
    trainer, _, explicit_losses, explicit_evaluated = train_and_evaluate(explicit)
    assert losses == explicit_losses and evaluated == explicit_evaluated
    assert not [n for n in trainer.notes if n.startswith("from_linen")]  # given, not inferred: no note


def test_deterministic_argument_is_inferred():
    factory = jaxpar.from_linen(Deterministic(), jnp.zeros((1, 8)))
    assert (factory.train_kwargs, factory.eval_kwargs) == ({"deterministic": False}, {"deterministic": True})
    assert factory.notes == ["from_linen: Deterministic.__call__ takes deterministic: it is called with "
                             "deterministic=False in training and deterministic=True in evaluation (pass "
                             "train_kwargs / eval_kwargs to choose otherwise)"]
    trainer, state, losses, evaluated = train_and_evaluate(factory)
    params = trainer.params(state)["linen"]
    held_out = batch(9)
    expected = jnp.mean((Deterministic().apply({"params": params}, held_out["x"], deterministic=True)
                         - held_out["y"]) ** 2)
    assert evaluated == pytest.approx(float(expected), abs=1e-5) and all(np.isfinite(losses))


def test_a_required_argument_nothing_supplies_names_it_and_the_kwargs():
    factory = jaxpar.from_linen(Training(), jnp.zeros((1, 8)))
    assert factory.notes == []
    with pytest.raises(jaxpar.ModelError, match=r"^from_linen: Training.__call__ needs the argument 'training', "
                                                r"which the initialisation does not give: pass "
                                                r"train_kwargs=\{'training': \.\.\.\} to jaxpar.from_linen"):
        jaxpar.Trainer(factory, loss_fn, optax.sgd(0.1), jaxpar.make_mesh("8"))
    factory = jaxpar.from_linen(Training(), jnp.zeros((1, 8)), train_kwargs={"training": True})
    trainer = jaxpar.Trainer(factory, loss_fn, optax.sgd(0.1), jaxpar.make_mesh("8"))
    state, _ = trainer.step(trainer.init(0), batch(0))  # training gets it
    with pytest.raises(jaxpar.ModelError, match=r"^from_linen: Training.__call__ needs the argument 'training', "
                                                r"which the call in evaluation does not give: pass "
                                                r"eval_kwargs=\{'training': \.\.\.\}") as info:
        trainer.evaluate(state, batch(0))
    assert "\n" not in str(info.value)
