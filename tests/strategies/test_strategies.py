"""Every strategy at its limit equals sync SGD; SSP/ASP replay the simulated parameter server exactly; local steps
do not communicate. Tolerances: float32, parameters atol 2e-5 after 5 steps (different summation order)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax import nnx

import jaxpar
from jaxpar.cost.hlo import collective_ops, collective_stats
from jaxpar.strategies.simulation import simulate_ps
from jaxpar.strategies.stragglers import parse_stragglers
from tests.helpers import batch_for, trainer_for

ATOL = 2e-5


def train(strategy, mesh="2x4", model="mlp", steps=5, optimizer=None, dropout=0.0):
    trainer = trainer_for(model, mesh, optimizer=optimizer, strategy=strategy, dropout=dropout)
    state = trainer.init(0)
    history = []
    for step in range(steps):
        state, metrics = trainer.step(state, batch_for(model, size=16, seed=step))
        history.append({k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0})
    return trainer, state, history


def assert_same_params(a, b, atol=ATOL):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=atol, rtol=ATOL), a, b)


_SYNC_RUNS = {}


def sync_reference(mesh, model="mlp"):
    """(parameters on the host, history) of 5 Sync() steps, run once per (mesh, model) in this test process: the
    reference several tests compare with."""
    if (mesh, model) not in _SYNC_RUNS:
        trainer, state, history = train(jaxpar.Sync(), mesh, model)
        _SYNC_RUNS[mesh, model] = jax.device_get(trainer.params(state)), history
    return _SYNC_RUNS[mesh, model]


@pytest.mark.slow
@pytest.mark.parametrize("mesh, model", [("2x4", "mlp"), ("8x1", "mlp"), ("2x4", "transformer"),
                                         ("data=2,fsdp=2,model=2", "mlp")])
def test_every_allreduce_algorithm_trains_exactly_like_the_compiler_allreduce(mesh, model):
    expected, reference = sync_reference(mesh, model)
    for algorithm in ("psum", "ring", "torus2d", "ps"):
        trainer, state, history = train(jaxpar.Sync(algorithm), mesh, model)
        np.testing.assert_allclose([h["loss"] for h in history], [h["loss"] for h in reference], rtol=1e-5)
        assert_same_params(trainer.params(state), expected)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [jaxpar.LocalSGD(period=1), jaxpar.DiLoCo(period=1, outer_optimizer=optax.sgd(1.0)),
                                      jaxpar.SSP(staleness=0), jaxpar.LocalSGD(period=4, local_after=5)],
                         ids=["local_sgd_H1", "diloco_H1_outer_sgd1", "ssp_S0", "post_local_sync_phase"])
@pytest.mark.parametrize("mesh", ["2x4", "data=2,fsdp=2,model=2"])
def test_strategies_at_their_limit_equal_sync_sgd(strategy, mesh):
    expected, reference = sync_reference(mesh)
    trainer, state, history = train(strategy, mesh)
    np.testing.assert_allclose([h["loss"] for h in history], [h["loss"] for h in reference], rtol=1e-5)
    assert_same_params(trainer.params(state), expected)


def assert_same_adam_params(a, b, lr, steps):
    """Equal within ATOL, except that Adam may turn a summation-order difference in a gradient entry at float noise
    level (~1e-9) into a different update of up to 2 x lr per step (m / sqrt(v) is about +-1 there): at most 0.1% of
    the entries may differ, by at most 2 x lr x steps."""
    x, y = np.concatenate([v.ravel() for v in jax.tree.leaves(a)]), np.concatenate([v.ravel() for v in jax.tree.leaves(b)])
    off = ~np.isclose(x, y, atol=ATOL, rtol=ATOL)
    assert off.mean() <= 1e-3, f"{off.sum()} of {off.size} entries differ"
    assert np.abs(x - y).max() <= 2 * lr * steps


@pytest.mark.slow
def test_ssp_zero_and_post_local_sync_phase_equal_sync_with_adam_too():
    reference_trainer, reference_state, _ = train(jaxpar.Sync(), "4x2", optimizer=optax.adam(1e-2))
    for strategy in (jaxpar.SSP(staleness=0), jaxpar.LocalSGD(period=3, local_after=5)):
        trainer, state, _ = train(strategy, "4x2", optimizer=optax.adam(1e-2))
        assert_same_adam_params(trainer.params(state), reference_trainer.params(reference_state), 1e-2, 5)


@pytest.mark.slow
def test_diloco_with_outer_sgd_lr_1_is_local_sgd_and_nesterov_differs():
    local_trainer, local_state, _ = train(jaxpar.LocalSGD(period=2), "4x2", steps=6)
    diloco_trainer, diloco_state, _ = train(jaxpar.DiLoCo(period=2, outer_optimizer=optax.sgd(1.0)), "4x2", steps=6)
    assert_same_params(diloco_trainer.params(diloco_state), local_trainer.params(local_state))
    nesterov_trainer, nesterov_state, _ = train(jaxpar.DiLoCo(period=2), "4x2", steps=6)
    difference = np.abs(nesterov_trainer.params(nesterov_state)["out"]["kernel"]
                        - local_trainer.params(local_state)["out"]["kernel"]).max()
    assert difference > 1e-3


def test_local_sgd_schedule_divergence_and_one_compile_per_variant():
    strategy = jaxpar.LocalSGD(period=3, local_after=2)
    trainer, state, history = train(strategy, "4x2", steps=8)
    variants = [strategy.plan(trainer.ctx, n).variant for n in range(8)]
    assert variants == ["sync", "sync", "local", "local", "meet", "local", "local", "meet"]
    assert [("replica_divergence" in h) for h in history] == [v == "meet" for v in variants]
    divergences = [h["replica_divergence"] for h in history if "replica_divergence" in h]
    assert all(0 < d < 0.5 for d in divergences)
    assert trainer.trace_counts == {"sync": 1, "local": 1, "meet": 1}
    # after a meeting every replica holds the anchor
    replica_params = jax.device_get(state.strategy_state["params"]["hidden"]["kernel"])
    for r in range(4):
        np.testing.assert_allclose(replica_params[r], trainer.params(state)["hidden"]["kernel"], atol=1e-6)


@pytest.mark.slow
def test_replica_state_is_sharded_over_data_and_keeps_tensor_parallelism():
    trainer, state, _ = train(jaxpar.LocalSGD(period=2), "2x4", steps=1)
    kernel = state.strategy_state["params"]["hidden"]["kernel"]
    assert kernel.shape == (2, 64, 32)
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("data", None, "model")
    assert kernel.addressable_shards[0].data.shape == (1, 64, 8)


def compiled_stats(trainer, state, variant, model="mlp"):
    batch = trainer.shard_batch(batch_for(model, size=16))
    inputs = trainer.strategy.plan(trainer.ctx, 0).inputs
    return collective_stats(trainer._steps[variant].lower(state, batch, inputs).compile())


@pytest.mark.slow
def test_local_step_has_no_cross_replica_collective_on_parameters():
    trainer = trainer_for("mlp", "8x1", strategy=jaxpar.LocalSGD(period=4))
    state = trainer.init(0)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    local = compiled_stats(trainer, state, "local")
    meet = compiled_stats(trainer, state, "meet")
    assert local.get("collective-permute", {"count": 0})["count"] == 0
    assert local.get("all-gather", {"count": 0})["count"] == 0
    assert local.get("all-reduce", {"count": 0})["count"] == 0  # not even the metric means or the non-finite flag
    assert meet["all-reduce"]["bytes"] >= param_bytes  # the meeting averages every parameter


def mlp_loss(params, images, labels):
    hidden = jax.nn.relu(images.reshape(len(images), -1) @ params["hidden"]["kernel"] + params["hidden"]["bias"])
    logits = hidden @ params["out"]["kernel"] + params["out"]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@pytest.mark.parametrize("strategy_factory, bound", [(lambda s: jaxpar.SSP(staleness=1, stragglers=s), 1),
                                                     (lambda s: jaxpar.ASP(stragglers=s, horizon=12), None)],
                         ids=["ssp1", "asp"])
@pytest.mark.slow
def test_stale_updates_replay_the_simulated_parameter_server_exactly(strategy_factory, bound):
    """Reference: a plain single-device loop that applies, at each server update, the mean gradient of the
    participants, each computed on the parameter version it read and its own slice of that step's batch."""
    stragglers, replicas, steps, lr = "1:3.0,3:2.0", 4, 12, 0.1
    trainer, state, history = train(strategy_factory(stragglers), "4x2", steps=steps, optimizer=optax.sgd(lr))
    schedule = simulate_ps(parse_stragglers(stragglers), replicas, bound, steps)
    assert max(u.staleness.max() for u in schedule) >= 1  # the test exercises stale reads
    versions = [trainer_for("mlp", "1x1").params(trainer_for("mlp", "1x1").init(0))]
    for step, update in enumerate(schedule):
        batch = batch_for("mlp", size=16, seed=step)
        grads = []
        for r in np.flatnonzero(update.participants):
            rows = slice(4 * r, 4 * r + 4)
            read = versions[step - update.staleness[r]]
            grads.append(jax.grad(mlp_loss)(read, batch["image"][rows], batch["label"][rows]))
        mean_grad = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
        versions.append(jax.tree.map(lambda p, g: p - lr * g, versions[-1], mean_grad))
        assert history[step]["contributors"] == update.participants.sum()
        assert history[step]["staleness_max"] == update.staleness[update.participants].max()
    assert_same_params(trainer.params(state), jax.tree.map(np.asarray, versions[-1]), atol=1e-5)


def test_asp_refuses_a_version_buffer_that_does_not_fit():
    with pytest.raises(jaxpar.ConfigError, match=r"^strategy='asp': the schedule's largest staleness is 1, so the "
                                                 r"parameter-version buffer needs 2 x [\d,]+ bytes per device"):
        trainer_for("mlp", "4x2", strategy=jaxpar.ASP(stragglers="3:2.0", horizon=50, max_buffer_bytes=1000))


def test_asp_slow_replica_contributes_half_as_often_on_device():
    trainer, state, history = train(jaxpar.ASP(stragglers="3:2.0", horizon=20), "4x2", steps=20)
    assert sum(h["contributors"] for h in history) == 20 * 3 + 10
    assert [h["sim_time"] for h in history] == list(range(1, 21))
    assert history[-1]["version_buffer"] == 2


def test_sync_charges_the_slowest_replica_and_local_sgd_waits_only_at_meetings():
    _, _, sync = train(jaxpar.Sync(stragglers="3:2.0"), "4x2", steps=4)
    assert [h["sim_time"] for h in sync] == [2.0, 4.0, 6.0, 8.0]
    _, _, local = train(jaxpar.LocalSGD(period=2, stragglers="3:2.0"), "4x2", steps=4)
    assert [h["sim_time"] for h in local] == [1.25, 4.0, 5.25, 8.0]


def test_explicit_strategies_draw_different_dropout_masks_per_replica():
    """The mechanism every shard_map strategy uses: the replica index is folded into the dropout key."""
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from jaxpar.strategies import replicas as rep
    from tests.parallel.test_equivalence import Dropper

    trainer = jaxpar.Trainer(Dropper, lambda m, b: (m(b["x"]).sum(), {}), optax.sgd(0.0), jaxpar.make_mesh("8x1"),
                             strategy=jaxpar.Sync("psum"))
    state = trainer.init(0)

    def own_mask(params, model_state):
        model = nnx.merge(trainer.ctx.graphdef, params, rep.fold_rng_keys(model_state, rep.replica_index()))
        return (model(jnp.ones((1, 64))) != 0)

    masks = jax.jit(rep.per_replica(trainer.ctx, own_mask, in_specs=(P(), P()), out_specs=P("data")))(
        state.params, state.model_state)
    masks = np.asarray(masks)
    assert masks.shape == (8, 64)
    assert len({row.tobytes() for row in masks}) == 8
    # and the strategy trains with them
    state, metrics = trainer.step(state, {"x": np.ones((8, 64), np.float32)})
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.slow
def test_300_steps_of_ring_allreduce_through_the_real_loop():
    """Trainer.fit (two steps in flight, donated states) with the hand-written ring over 8 replicas follows the
    compiler's all-reduce step for step on the digits, and learns them."""
    from jaxpar.io import data

    train_split, _ = data.load_digits()
    runs = {}
    for name, strategy in (("ring", jaxpar.Sync("ring")), ("compiler", jaxpar.Sync())):
        trainer = trainer_for("mlp", "8x1", optimizer=optax.adam(3e-3), strategy=strategy)
        losses = []
        state = trainer.fit(trainer.init(0), data.array_batches(train_split, 64, seed=0), steps=300,
                            on_step=lambda step, metrics: losses.append(metrics["loss"]))
        runs[name] = (int(state.step), np.array(losses), trainer.params(state))
    (ring_steps, ring, ring_params), (steps, compiler, params) = runs["ring"], runs["compiler"]
    assert ring_steps == steps == 300 and len(ring) == 300
    np.testing.assert_allclose(ring, compiler, rtol=1e-3, atol=1e-4)
    assert_same_adam_params(ring_params, params, 3e-3, 300)
    assert ring[-20:].mean() < 0.25 * ring[:5].mean()  # it learns the digits


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["2x4", "data=2,fsdp=2,model=2"])
def test_hand_written_allreduce_with_tensor_parallelism_sends_only_the_local_model_shard(mesh):
    """Each device holds 1/4 of a sharded gradient (over model, or fsdp x model); the ring over the replica axis
    moves only that shard."""
    trainer = trainer_for("transformer", mesh, strategy=jaxpar.Sync("ring"))
    state = trainer.init(0)
    local_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params))
    full_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    sent = compiled_stats(trainer, state, "sync", "transformer")["collective-permute"]["bytes"]
    n = 2  # ring over 2 replicas: 2(N-1)/N of the buffer (plus padding)
    assert local_bytes * 2 * (n - 1) / n <= sent <= local_bytes * 2 * (n - 1) / n + 64
    assert sent < full_bytes / 2


def test_local_after_beyond_the_first_clock_window_plans_fine():
    trainer = trainer_for("mlp", "4x2", strategy=jaxpar.LocalSGD(period=4, local_after=2000))
    plans = [trainer.strategy.plan(trainer.ctx, n) for n in (0, 1999, 2000, 2003)]
    assert [p.variant for p in plans] == ["sync", "sync", "local", "meet"]
    assert trainer.clock.time_after(4, 1999) == 2000.0


def test_asp_buffer_is_fixed_by_the_horizon_and_a_stale_read_beyond_it_is_refused():
    # replica 3 at half speed: every other update applies its gradient one version old
    strategy = jaxpar.ASP(stragglers="3:2.0", horizon=4)
    trainer = trainer_for("mlp", "4x2", strategy=strategy)
    assert strategy.buffer_size(4) == 2
    assert strategy.plan(trainer.ctx, 101).host_metrics["staleness_max"] == 1  # past the horizon: the compiled buffer
    assert strategy.buffer_size(4) == 2
    # a horizon of 1 update sees no staleness (buffer 1); update 1 reads a version 1 update old: refused
    short = jaxpar.ASP(stragglers="3:2.0", horizon=1)
    assert short.buffer_size(4) == 1
    short.plan(trainer.ctx, 0)
    with pytest.raises(jaxpar.JaxparError, match=r"^asp: update 1 needs a version 1 updates old but the buffer "
                                                 r"holds 1; plan at least as many updates as you train \(horizon\)$"):
        short.plan(trainer.ctx, 1)


def test_local_sgd_replicas_stay_sharded_over_fsdp_and_model_inside_the_replica():
    trainer, state, _ = train(jaxpar.LocalSGD(period=2), "data=2,fsdp=2,model=2", steps=1)
    kernel = state.strategy_state["params"]["hidden"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("data", "fsdp", "model")
    assert kernel.addressable_shards[0].data.shape == (1, 32, 16)


def test_a_non_participant_replica_with_nan_gradients_does_not_poison_the_update():
    """SSP/ASP mask non-participants with a select: 0 x NaN would be NaN."""
    strategy = jaxpar.ASP(stragglers="3:2.0", horizon=4)
    trainer = trainer_for("mlp", "4x2", strategy=strategy)
    assert not strategy.plan(trainer.ctx, 0).inputs["participation"][3]  # replica 3 is still computing
    batch = batch_for("mlp", size=16)
    batch["image"][12:] = np.nan  # replica 3's slice
    state, metrics = trainer.step(trainer.init(0), batch)
    assert np.isfinite(float(metrics["loss"]))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(trainer.params(state)))
    clean = batch_for("mlp", size=16)
    reference, _ = trainer_for("mlp", "4x2", strategy=jaxpar.ASP(stragglers="3:2.0", horizon=4)).step(
        trainer_for("mlp", "4x2", strategy=jaxpar.ASP(stragglers="3:2.0", horizon=4)).init(0), clean)
    assert_same_params(trainer.params(state), trainer.params(reference))


def test_schedules_and_clocks_are_pure_functions_of_replica_count_and_step():
    strategy = jaxpar.ASP(stragglers="1:2.0", horizon=8)
    four, two = trainer_for("mlp", "4x2", strategy=strategy), trainer_for("mlp", "2x4", strategy=strategy)
    late = strategy.plan(four.ctx, 6)
    assert strategy.plan(two.ctx, 6).inputs["participation"].shape == (2,)
    assert late.inputs["participation"].shape == (4,)
    np.testing.assert_array_equal(strategy.plan(four.ctx, 6).inputs["staleness"], late.inputs["staleness"])
    fresh = jaxpar.ASP(stragglers="1:2.0", horizon=8)
    assert [fresh.plan(four.ctx, n).host_metrics for n in range(8)] == \
        [strategy.plan(four.ctx, n).host_metrics for n in range(8)]
    assert [fresh.clock.time_after(4, n) for n in range(8)] == [strategy.clock.time_after(4, n) for n in range(8)]
    sync = jaxpar.Sync(stragglers="1:2.0")
    assert sync.clock.time_after(4, 3) == 8.0
    assert trainer_for("mlp", "2x4", strategy=sync).clock.time_after(2, 3) == 8.0
    assert jaxpar.Sync().clock.time_after(4, 3) == 4.0
    assert sync.clock.time_after(4, 3) == 8.0


def test_examples_count_only_contributing_replicas_under_asp():
    trainer, _, history = train(jaxpar.ASP(stragglers="3:2.0", horizon=6), "4x2", steps=6)
    assert [h["examples"] for h in history] == [16 * h["contributors"] / 4 for h in history]
    assert [h["examples"] for h in history] == [12.0, 16.0, 12.0, 16.0, 12.0, 16.0]
    from jaxpar.io.metrics import RunLogger
    import io
    logger = RunLogger(2, 16, 2, stream=io.StringIO())
    logger.on_step(1, {"loss": 1.0, "examples": 12.0})
    logger._last_time -= 1.0  # one second since the first record
    logger.on_step(2, {"loss": 1.0, "examples": 4.0})
    assert "4 samples/s" in logger.stream.getvalue().splitlines()[-1]


class Counter(nnx.Variable):
    """A user's own state (an EMA, a cache): never averaged across replicas."""


class WithCounter(nnx.Module):
    def __init__(self, rngs):
        self.scale = nnx.Param(jnp.ones((4,)))
        self.seen = Counter(jnp.zeros(()))
        self.stat = nnx.BatchStat(jnp.zeros(()))

    def __call__(self, x):
        self.seen[...] = x.sum()
        self.stat[...] = x.sum()
        return (x * self.scale).sum()


def test_only_batch_statistics_are_averaged_across_replicas():
    trainer = jaxpar.Trainer(WithCounter, lambda m, b: (m(b["x"]), {}), optax.sgd(0.0), jaxpar.make_mesh("8x1"),
                             strategy=jaxpar.Sync("psum"))
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)  # replica r sees row r
    state, _ = trainer.step(trainer.init(0), {"x": x})
    stat = float(jax.device_get(state.model_state["stat"].get_value()))
    seen = [float(s.data) for s in state.model_state["seen"].get_value().addressable_shards]
    assert stat == pytest.approx(x.sum(axis=1).mean())  # BatchStat: the mean over replicas
    assert seen == pytest.approx(list(x.sum(axis=1)))  # the user's variable: each replica keeps its own


@pytest.mark.parametrize("skip", [True, False])
def test_a_local_step_checks_each_replica_on_its_own(skip):
    """A NaN in replica 3's slice: under skip only replica 3 keeps its state (the others take their step), and the
    step's per-replica `skipped` is [0, 0, 0, 1]; without skip it is flagged as `nonfinite` for replica 3 alone."""
    trainer = trainer_for("mlp", "4x2", strategy=jaxpar.LocalSGD(period=4), skip_nonfinite=skip)
    state = trainer.init(0)
    before = jax.device_get(state.strategy_state["params"])
    batch = batch_for("mlp", size=16)
    batch["image"][12:] = np.nan  # replica 3's rows
    state, metrics = trainer.step(state, batch, 0)
    name = "skipped" if skip else "nonfinite"
    np.testing.assert_array_equal(metrics[name + "_per_replica"], [0.0, 0.0, 0.0, 1.0])
    assert metrics[name] == 0.25  # the scalar every strategy reports: the replica mean
    after = jax.device_get(state.strategy_state["params"])
    kernel_before, kernel_after = before["hidden"]["kernel"], after["hidden"]["kernel"]
    assert not np.array_equal(kernel_after[0], kernel_before[0])  # replica 0 took its step
    if skip:
        np.testing.assert_array_equal(kernel_after[3], kernel_before[3])  # replica 3 kept its state
    else:
        assert not np.isfinite(kernel_after[3]).all()
    assert np.isfinite(kernel_after[:3]).all()


def test_a_meeting_checks_each_replica_on_its_own_and_averages_the_finite_copies():
    """Period 1 (every step a meeting), a NaN in replica 3's rows: replica 3 brings its previous copy, the anchor
    is the mean of three new copies and that old one (finite), and the meeting's only data collective is the
    parameter average."""
    trainer = trainer_for("mlp", "4x2", strategy=jaxpar.LocalSGD(period=1))
    state = trainer.init(0)
    before = trainer.params(state)["hidden"]["kernel"]
    clean = batch_for("mlp", size=16)
    poisoned = {k: v.copy() for k, v in clean.items()}
    poisoned["image"][12:] = np.nan
    state, metrics = trainer.step(state, poisoned, 0)
    np.testing.assert_array_equal(metrics["skipped_per_replica"], [0.0, 0.0, 0.0, 1.0])
    anchor = trainer.params(state)["hidden"]["kernel"]
    assert np.isfinite(anchor).all() and not np.allclose(anchor, before)
    batch = trainer.shard_batch(clean)
    ops = collective_ops(trainer._steps["meet"].lower(state, batch, {}).compile(), trainer.mesh)
    over_data = [op for op in ops if "data" in op.axes]
    assert len(over_data) == 1 and over_data[0].kind == "all-reduce"  # the average; no metric mean, no flag


def test_a_meeting_whose_result_is_not_finite_is_skipped_as_a_whole():
    """DiLoCo with an outer step that overflows: every replica's own step is finite, the averaged anchor is not;
    the whole meeting is skipped (anchor and replicas unchanged) and every replica reports it."""
    trainer = trainer_for("mlp", "4x2", strategy=jaxpar.DiLoCo(period=1, outer_optimizer=optax.chain(optax.scale(1e30), optax.scale(-1e30))))
    state = trainer.init(0)
    before = trainer.params(state)
    state, metrics = trainer.step(state, batch_for("mlp", size=16), 0)
    np.testing.assert_array_equal(metrics["skipped_per_replica"], [1.0] * 4)
    assert metrics["skipped"] == 1.0
    assert_same_params(trainer.params(state), before, atol=0)
    replicas = jax.device_get(state.strategy_state["params"]["hidden"]["kernel"])
    np.testing.assert_array_equal(replicas[2], before["hidden"]["kernel"])


@pytest.mark.parametrize("strategy", [jaxpar.Sync(), jaxpar.Sync("ring"), jaxpar.LocalSGD(period=2),
                                      jaxpar.DiLoCo(period=2), jaxpar.SSP(1, horizon=4), jaxpar.ASP(horizon=4)],
                         ids=lambda s: f"{s.name}-{s.allreduce}")
def test_every_strategy_returns_the_same_metric_keys_as_scalars(strategy):
    """The metrics contract: `step` gives `loss` and the loss function's metrics as scalars under every strategy
    (a script's float(m["loss"]) works whichever strategy it runs); per-replica values only under their own keys."""
    trainer = trainer_for("mlp", "4x2", strategy=strategy)
    state = trainer.init(0)
    for step in range(2):  # local SGD: a local step, then a meeting
        state, metrics = trainer.step(state, batch_for("mlp", size=16, seed=step), step)
        for key in ("loss", "accuracy", "skipped"):
            value = metrics[key]
            assert value.shape == () and np.isfinite(value.item()) and np.isfinite(float(value)), (key, value)
        per_replica = {k for k in metrics if k.endswith("_per_replica")}
        if strategy.name in ("local_sgd", "diloco"):
            assert {"loss_per_replica", "accuracy_per_replica"} <= per_replica
            assert np.shape(metrics["loss_per_replica"]) == (4,)
            assert float(metrics["loss"]) == pytest.approx(float(np.mean(metrics["loss_per_replica"])), rel=1e-6)
        else:
            assert not per_replica


@pytest.mark.parametrize("strategy,mesh", [
    pytest.param(jaxpar.LocalSGD(period=2), "8", id="localsgd-8", marks=pytest.mark.slow),
    pytest.param(jaxpar.DiLoCo(period=3), "4x2", id="diloco-4", marks=pytest.mark.slow),
    pytest.param(jaxpar.LocalSGD(period=2), "2x4", id="localsgd-2")])
@pytest.mark.slow
def test_local_steps_average_per_replica_metrics_on_the_device_as_numpy_does(strategy, mesh, monkeypatch):
    """`trainer.step` under local SGD / DiLoCo reads nothing back (the host runs ahead; it used to read the [R]
    metrics every step) and its means are bit-identical to the host's numpy mean that `fit` reports."""
    from jaxpar.train.loop import replica_means

    trainer = trainer_for("mlp", mesh, strategy=strategy, dropout=0.1)
    state = trainer.init(0)
    seen = []
    on_device = trainer._replica_means
    trainer._replica_means = lambda metrics: seen.append(metrics) or on_device(metrics)
    for step in range(4):  # local steps and meetings
        batch = trainer.shard_batch(batch_for("mlp", size=32, seed=step))
        with monkeypatch.context() as patched:
            patched.setattr(jax, "device_get", lambda *a: pytest.fail("trainer.step read metrics back"))
            state, means = trainer.step(state, batch, step)
        host = replica_means(seen[-1])  # what `step` returned before, and what `fit` reports
        assert set(means) == set(host)
        for key in ("loss", "accuracy"):
            assert isinstance(means[key], jax.Array) and means[key].shape == ()
            assert np.asarray(means[key]).tobytes() == host[key].tobytes(), (step, key, means[key], host[key])
            np.testing.assert_array_equal(np.asarray(means[key + "_per_replica"]), host[key + "_per_replica"])
            assert host[key + "_per_replica"].shape == (trainer.num_replicas,)
    assert len(seen) == 4 and len({float(m["loss"][0]) for m in seen}) == 4


@pytest.mark.parametrize("replicas", [2, 4, 8])
def test_the_device_mean_of_replica_values_is_numpys_bit_for_bit(replicas):
    """Values over 8 orders of magnitude, both signs: the device's ((x0 + x1) + ...) / R is numpy's mean."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxpar.train.replica_metrics import ReplicaMeans

    mesh = jaxpar.make_mesh(f"data={replicas},model={8 // replicas}")
    means = ReplicaMeans(mesh)
    rng = np.random.default_rng(replicas)
    for trial in range(20):
        values = (rng.standard_normal(replicas) * 10.0 ** rng.integers(-4, 5, replicas)).astype(np.float32)
        placed = jax.device_put(values, NamedSharding(mesh, P("data")))
        out = means({"loss": placed, "examples": 32.0})
        assert np.asarray(out["loss"]).tobytes() == np.asarray(np.mean(values, axis=0)).tobytes(), values
        assert out["examples"] == 32.0 and out["loss_per_replica"] is placed
