import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import jaxpar
from jaxpar.io import data
from tests.helpers import batch_for, trainer_for


def test_step_is_compiled_once():
    trainer = trainer_for("transformer", "2x4", dropout=0.1)
    state = trainer.init(0)
    state, _ = trainer.step(state, batch_for("transformer", seed=0))
    compiles = []

    def listener(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for step in range(1, 5):
            state, metrics = trainer.step(state, batch_for("transformer", seed=step))
        state, metrics = trainer.step(state, jax.device_put(batch_for("transformer"), trainer.batch_sharding))
        jax.block_until_ready(metrics)
        steady = list(compiles)
        trainer.step(state, batch_for("transformer", size=8))  # a new shape must compile: the listener works
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert steady == [] and trainer.trace_count == 2 and len(compiles) >= 1


def test_state_is_donated_and_metrics_include_loss_fn_metrics():
    trainer = trainer_for("mlp", "2x4")
    state = trainer.init(0)
    new_state, metrics = trainer.step(state, batch_for("mlp"))
    # sim_time: the simulated clock (no stragglers: 1 per step); examples: how many examples the update applied
    # compiled: this call compiled the step (the first one does); skipped: 1.0 if the non-finite guard kept the state;
    # flops: the compiled step's FLOPs on all devices (XLA's cost analysis)
    assert set(metrics) == {"loss", "accuracy", "sim_time", "examples", "compiled", "skipped", "flops"}
    assert metrics["examples"] == 16 and float(metrics["skipped"]) == 0.0
    assert jax.tree.leaves(state.params)[0].is_deleted()  # buffers reused in place
    assert int(new_state.step) == 1
    assert "compiled" not in trainer.step(new_state, batch_for("mlp"))[1]


def test_params_are_gathered_numpy():
    trainer = trainer_for("mlp", "2x4")
    params = trainer.params(trainer.init(0))
    assert isinstance(params["hidden"]["kernel"], np.ndarray)
    assert params["hidden"]["kernel"].shape == (64, 32)


def test_batch_not_divisible_by_data_axis_is_a_clear_error():
    trainer = trainer_for("mlp", "4x2")
    with pytest.raises(jaxpar.JaxparError, match=r"global batch size 10 does not divide by the 4 devices the batch is "
                                                 r"split over \(data x fsdp\); use a multiple of 4, e.g. 8"):
        trainer.step(trainer.init(0), batch_for("mlp", size=10))


@pytest.mark.slow
def test_fit_runs_300_steps_through_the_real_loop_and_learns_digits():
    """Hundreds of collective-bearing steps on 8 CPU devices: the bounded in-flight loop must not deadlock."""
    trainer = trainer_for("mlp", "4x2", optimizer=optax.adam(3e-3))
    train, test = data.load_digits()
    seen = []
    state = trainer.fit(trainer.init(0), data.array_batches(train, 64, seed=0), steps=300,
                        on_step=lambda step, metrics: seen.append((step, metrics["loss"])))
    assert [s for s, _ in seen] == list(range(1, 301))
    assert int(state.step) == 300
    accuracy = float(trainer.evaluate(state, {k: v[:296] for k, v in test.items()})["accuracy"])
    assert accuracy > 0.9, accuracy


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
        return nn.Dense(3, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", None)))(
            nn.relu(x))


def test_linen_module_through_the_adapter_is_sharded_and_mesh_invariant():
    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=(16, 3)).astype(np.float32)}
    results = {}
    for mesh in ("1x1", "2x4"):
        trainer = jaxpar.Trainer(jaxpar.from_linen(LinenMLP(), jnp.zeros((1, 8))), loss_fn, optax.sgd(0.1),
                                 jaxpar.make_mesh(mesh))
        state = trainer.init(0)
        for _ in range(3):
            state, metrics = trainer.step(state, batch)
        results[mesh] = trainer.params(state), float(metrics["loss"])
    kernel = state.params["linen"]["Dense_0"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    np.testing.assert_allclose(results["2x4"][1], results["1x1"][1], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), results["2x4"][0], results["1x1"][0])
