"""Checkpoints through the library: restore onto other meshes and strategies, corrupt / mismatched / interrupted
checkpoints, and the numerical-fault guards (skipped non-finite steps, replica fingerprints)."""

import os
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

import jaxpar
from jaxpar.train import actions
from jaxpar.io.checkpoint import MANIFEST, Checkpointer
from jaxpar.errors import CheckpointError, ReplicaMismatch, TrainingDiverged
from jaxpar.train.faults import ReplicaCheck
from tests.helpers import batch_for, trainer_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESHES = ["4x2", "1x8", "8x1", "1x1", "fsdp=8", "data=2,fsdp=2,model=2"]


def trained(mesh="2x4", strategy=None, steps=3, **kw):
    trainer = trainer_for("mlp", mesh, optimizer=optax.adamw(1e-2), strategy=strategy, **kw)
    state = trainer.init(0)
    for i in range(steps):
        state, _ = trainer.step(state, batch_for("mlp", 16, seed=i))
    return trainer, state


def leaves_equal(a, b) -> bool:
    """Bit-identical trees (typed PRNG keys compared by their key data)."""
    def bits(tree):
        return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
                for x in jax.tree.leaves(tree)]
    return all(np.array_equal(x, y) for x, y in zip(bits(a), bits(b), strict=True))


@pytest.fixture(scope="module")
def sync_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sync")
    trainer, state = trained()
    checkpoints = Checkpointer(str(folder), keep=2)
    checkpoints.save(3, state, trainer.strategy, trainer.num_replicas, batches={"position": 48, "step": 3})
    checkpoints.wait()
    params = trainer.params(state)
    state, metrics = trainer.step(state, batch_for("mlp", 16, seed=3))
    return checkpoints, params, float(metrics["loss"])


@pytest.mark.parametrize("mesh", MESHES)
def test_a_checkpoint_from_2x4_restores_identically_on_another_mesh_and_trains_on(sync_checkpoint, mesh):
    checkpoints, params, next_loss = sync_checkpoint
    trainer = trainer_for("mlp", mesh, optimizer=optax.adamw(1e-2))
    state, meta, notes = checkpoints.restore(trainer)
    assert notes == [] and meta["batches"] == {"position": 48, "step": 3} and int(state.step) == 3
    assert leaves_equal(trainer.params(state), params)
    state, metrics = trainer.step(state, batch_for("mlp", 16, seed=3))
    np.testing.assert_allclose(float(metrics["loss"]), next_loss, rtol=1e-6)  # the mesh-invariance tolerance


@pytest.mark.slow
def test_local_sgd_replicas_are_averaged_on_another_replica_count_and_said_once(tmp_path):
    trainer, state = trained("2x4", jaxpar.LocalSGD(period=2))  # step 3: replicas apart since the meeting at 2
    replicas = jax.device_get(state.strategy_state["params"])
    mean = jax.tree.map(lambda x: x.mean(axis=0), replicas)
    checkpoints = Checkpointer(str(tmp_path))
    checkpoints.save(3, state, trainer.strategy, trainer.num_replicas)
    checkpoints.wait()
    state_same = checkpoints.restore(trainer)[0]
    assert leaves_equal(jax.device_get(state_same.strategy_state["params"]), replicas)  # same mesh: exact
    other = trainer_for("mlp", "4x2", optimizer=optax.adamw(1e-2), strategy=jaxpar.LocalSGD(period=2))
    restored, _, notes = checkpoints.restore(other)
    assert notes == ["checkpoint step 3 was written by local_sgd on 2 replicas; this run is local_sgd on 4 replicas: "
                     "the 2 replicas' parameters, optimizer and BatchNorm states were averaged, as at a meeting"]
    for got, want in zip(jax.tree.leaves(jax.device_get(restored.strategy_state["params"])), jax.tree.leaves(mean)):
        np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-6)
    restored, metrics = other.step(restored, batch_for("mlp", 16, seed=3))
    assert np.isfinite(np.asarray(metrics["loss"])).all()  # a local step's loss: one per replica


@pytest.mark.slow
def test_ssp_restores_exactly_and_a_checkpoint_moves_between_strategies(tmp_path):
    trainer, state = trained("2x4", jaxpar.SSP(staleness=2, stragglers="1:2.0"), steps=4)
    checkpoints = Checkpointer(str(tmp_path))
    checkpoints.save(4, state, trainer.strategy, trainer.num_replicas)
    checkpoints.wait()
    restored, _, notes = checkpoints.restore(trainer)
    assert notes == [] and leaves_equal(restored, state)
    sync = trainer_for("mlp", "2x4", optimizer=optax.adamw(1e-2))
    moved, _, notes = checkpoints.restore(sync)
    assert notes == ["checkpoint step 4 was written by ssp on 2 replicas; this run is sync on 2 replicas: its stale "
                     "parameter versions were dropped: every replica restarts from the current parameters; strategy "
                     "state of the new strategy starts fresh"]
    assert leaves_equal(sync.params(moved), trainer.params(state))
    assert leaves_equal(jax.device_get(moved.opt_state), jax.device_get(state.opt_state))


@pytest.mark.slow
def test_diloco_keeps_its_outer_optimizer_state_on_another_replica_count(tmp_path):
    """The restore table (`strategy_notes`, keyed by class): DiLoCo's anchor optimizer state carries over exactly
    while its replicas are averaged as local SGD's are."""
    trainer, state = trained("2x4", jaxpar.DiLoCo(period=2))
    checkpoints = Checkpointer(str(tmp_path))
    checkpoints.save(3, state, trainer.strategy, trainer.num_replicas)
    checkpoints.wait()
    other = trainer_for("mlp", "4x2", optimizer=optax.adamw(1e-2), strategy=jaxpar.DiLoCo(period=2))
    restored, _, notes = checkpoints.restore(other)
    assert notes == ["checkpoint step 3 was written by diloco on 2 replicas; this run is diloco on 4 replicas: the 2 "
                     "replicas' parameters, optimizer and BatchNorm states were averaged, as at a meeting"]
    assert leaves_equal(jax.device_get(restored.opt_state), jax.device_get(state.opt_state))
    fresh = other.init(0)  # a fresh outer optimizer state (momentum 0), which a restore would hold without `kept`
    assert not leaves_equal(jax.device_get(fresh.opt_state), jax.device_get(state.opt_state))


def test_the_restore_table_keys_by_class_and_knows_nothing_of_a_users_strategy(tmp_path):
    from jaxpar.io.checkpoint.strategy_notes import TABLE, UNCHANGED, notes_of
    from tests.strategies.test_user_strategy import PerStepSync

    assert notes_of(jaxpar.ASP) is TABLE[jaxpar.SSP] and notes_of(jaxpar.DiLoCo).kept == ("opt_state",)
    assert notes_of(jaxpar.Sync) is notes_of(PerStepSync) is notes_of(None) is UNCHANGED
    trainer, state = trained("2x4", PerStepSync())
    checkpoints = Checkpointer(str(tmp_path))
    checkpoints.save(3, state, trainer.strategy, trainer.num_replicas)
    checkpoints.wait()
    sync = trainer_for("mlp", "4x2", optimizer=optax.adamw(1e-2))
    moved, _, notes = checkpoints.restore(sync)
    assert notes == ["checkpoint step 3 was written by per_step_sync on 2 replicas; this run is sync on 4 replicas: "
                     "its parameters and optimizer state carry over unchanged; strategy state of the new strategy "
                     "starts fresh"]
    assert leaves_equal(sync.params(moved), trainer.params(state))


def test_a_checkpoint_of_another_model_lists_the_mismatched_shapes(sync_checkpoint):
    checkpoints = sync_checkpoint[0]
    wider = jaxpar.Trainer(**{**trainer_kwargs(hidden=64)})
    with pytest.raises(CheckpointError, match=r"^checkpoint_dir='.*': the checkpoint of step 3 is of another model or "
                                              r"optimizer \(params\.hidden\.bias\.value: checkpoint float32\[32\], "
                                              r"this model float32\[64\]; .*restore it with the model"):
        checkpoints.restore(wider)


def trainer_kwargs(hidden):
    import models
    from tests.helpers import TINY
    return dict(model=models.factory(TINY["mlp"].replace(hidden=hidden)), loss_fn=models.LOSSES["mlp"],
                optimizer=optax.adamw(1e-2), mesh=jaxpar.make_mesh("2x4"))


def test_a_corrupted_checkpoint_names_the_file_and_the_older_intact_one(tmp_path):
    trainer, state = trained(steps=1)
    checkpoints = Checkpointer(str(tmp_path), keep=3)
    checkpoints.save(1, state, trainer.strategy, trainer.num_replicas)
    state, _ = trainer.step(state, batch_for("mlp", 16, seed=1))
    checkpoints.save(2, state, trainer.strategy, trainer.num_replicas)
    checkpoints.wait()
    assert os.path.exists(tmp_path / "2" / MANIFEST)
    data_files = sorted((tmp_path / "2" / "state").rglob("d/*"), key=lambda p: -p.stat().st_size)
    victim = data_files[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated
    with pytest.raises(CheckpointError) as info:
        checkpoints.restore(trainer)
    message = str(info.value)
    assert f"the checkpoint of step 2 is unusable: file {victim} has" in message and "truncated" in message
    assert message.endswith("the checkpoint of step 1 is intact: resume from it with resume_step 1 (nothing was "
                            "deleted)")
    assert jaxpar.errors.cli_message(info.value).endswith("resume from it with --resume-step 1 (nothing was deleted)")
    assert checkpoints.steps() == [1, 2]  # nothing deleted
    flipped = bytearray(victim.read_bytes())
    restored, _, _ = checkpoints.restore(trainer, step=1)
    assert int(restored.step) == 1
    assert flipped  # the truncated file is left as it was


def test_a_manifest_being_written_meanwhile_is_not_listed_in_another(tmp_path):
    """The background thread and `wait` may write a step's manifest at once: neither lists the other's temporary."""
    from jaxpar.io.checkpoint import verify, write_manifest
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "data").write_bytes(b"x" * 100)
    stray = tmp_path / f".{MANIFEST}.abc123.tmp"
    stray.write_text("{}")
    write_manifest(str(tmp_path))
    stray.unlink()  # the other writer renamed it into place
    assert verify(str(tmp_path)) is None
    (tmp_path / "state" / "data").write_bytes(b"y" * 100)
    assert verify(str(tmp_path)).endswith("is corrupted (its checksum differs from the one written with it)")


def test_no_manifest_is_written_after_wait_returns(tmp_path, monkeypatch):
    """`save` starts a thread that writes the manifest once orbax has renamed the folder; `wait` joins it, so a
    file changed after `wait` (as the corruption test does) is never listed in a manifest written later."""
    import threading
    import time

    from jaxpar.io.checkpoint import checkpointer

    written = []  # (thread, time the manifest write ended)
    original, background = checkpointer.write_manifest, threading.Event()

    def slow_in_background(folder):
        if threading.current_thread() is not threading.main_thread():
            background.set()
            time.sleep(1.0)  # a late background writer
        original(folder)
        written.append((threading.current_thread().name, time.monotonic()))

    monkeypatch.setattr(checkpointer, "write_manifest", slow_in_background)
    trainer, state = trained(steps=1)
    checkpoints = Checkpointer(str(tmp_path))
    checkpoints.save(1, state, trainer.strategy, trainer.num_replicas)
    assert background.wait(60)  # the background writer has found the renamed folder and is writing
    checkpoints.wait()
    returned = time.monotonic()
    time.sleep(1.5)  # time enough for a writer that was not joined to finish
    assert written and all(end <= returned for _, end in written), (written, returned)
    assert any(name != threading.main_thread().name for name, _ in written)  # the background writer did write
    assert checkpoints.restore(trainer)[0] is not None


@pytest.mark.slow
def test_an_interrupted_save_is_never_listed(tmp_path):
    """SIGKILL right after `save` returns (the write still running in orbax's background thread)."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        sys.path.insert(0, {ROOT!r})
        import jax.numpy as jnp, optax, jaxpar
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jaxpar.io.checkpoint import Checkpointer
        from tests.helpers import trainer_for
        trainer = trainer_for("mlp", "2x4")
        checkpoints = Checkpointer({str(tmp_path)!r})
        state = trainer.init(0)
        checkpoints.save(1, state, trainer.strategy, 2)
        checkpoints.wait()
        big = jnp.ones((64, 1024, 1024))  # 256 MiB: its write takes a while
        checkpoints.save(2, state._replace(strategy_state={{"big": big}}), trainer.strategy, 2)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr[-1000:]
    assert Checkpointer(str(tmp_path)).steps() == [1]


# --- numerical faults ------------------------------------------------------------------------------------------------
def nan_batches(bad_steps, replica_rows=slice(8, 16)):
    step = 0
    while True:
        batch = batch_for("mlp", 16, seed=step)
        if step in bad_steps:
            batch["image"][replica_rows] = np.nan  # the second replica's shard only
        yield batch
        step += 1


def test_a_nan_in_one_shard_skips_the_step_with_the_state_bit_identical():
    trainer = trainer_for("mlp", "2x4", optimizer=optax.adamw(1e-2))
    history, states = [], {}

    class Keep(jaxpar.Action):
        needs_state = True

        def __call__(self, event):
            history.append(event.metrics)
            states[event.step] = jax.device_get((event.state.params, event.state.opt_state))

    guard = actions.StopIfDiverged(max_skips=3)
    state = trainer.fit(trainer.init(0), nan_batches({2}), 5, actions=[guard, Keep()])
    assert [m["skipped"] for m in history] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert history[2]["skipped_steps"] == 1.0 and history[4]["skipped_steps"] == 1.0
    assert leaves_equal(states[3], states[2]) and not leaves_equal(states[4], states[3])
    assert int(state.step) == 5
    assert ReplicaCheck(trainer.state_shardings.params, trainer.mesh).mismatches(state.params) == []


def test_more_consecutive_skips_than_allowed_abort():
    trainer = trainer_for("mlp", "2x4")
    with pytest.raises(jaxpar.FitError, match=r"^training diverged: 3 steps in a row were skipped \(loss nan at step "
                                              r"5\), more than max_skips 2; the state is that of step 2") as info:
        trainer.fit(trainer.init(0), nan_batches({2, 3, 4, 5, 6}), 8, actions=[actions.StopIfDiverged(max_skips=2)])
    assert isinstance(info.value.__cause__, TrainingDiverged)


def test_skipping_off_applies_the_non_finite_update():
    trainer = trainer_for("mlp", "2x4", skip_nonfinite=False)
    state, metrics = trainer.step(trainer.init(0), next(nan_batches({0})))
    assert "skipped" not in metrics
    assert not all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(trainer.params(state)))


def test_a_perturbed_copy_on_one_device_is_named():
    trainer = trainer_for("mlp", "4x2")
    state = trainer.init(0)
    kernel = state.params["hidden"]["kernel"].value  # split over model, replicated over the 4 replicas
    shards = []
    for shard in kernel.addressable_shards:
        data = np.asarray(shard.data)
        if shard.device == trainer.mesh.devices[2, 0, 0, 0, 1]:
            data = data.copy()
            data[0, 0] = np.nextafter(data[0, 0], np.inf)  # one ulp on one device
        shards.append(jax.device_put(data, shard.device))
    bad = jax.make_array_from_single_device_arrays(kernel.shape, kernel.sharding, shards)
    state.params["hidden"]["kernel"].value = bad
    check = ReplicaCheck(trainer.state_shardings.params, trainer.mesh)
    device = trainer.mesh.devices[2, 0, 0, 0, 1]
    with pytest.raises(ReplicaMismatch, match=rf"^replica check at step 7: parameter hidden\.kernel\.value: "
                                              rf"the copy on {device} \(data=2,model=1\) differs from the copy on "):
        check.check(state.params, 7)


def test_the_skip_counters_continue_across_a_resume():
    """run.py saves `StopIfDiverged.get_state()` with each checkpoint and sets it back on resume."""
    before = actions.StopIfDiverged(max_skips=2)
    for step, skipped in [(1, 0.0), (2, 1.0), (3, 1.0)]:
        before(actions.StepEvent(step, {"loss": 2.0, "skipped": skipped}, None, None, False))
    after = actions.StopIfDiverged(max_skips=2)
    after.set_state(json_roundtrip(before.get_state()))
    assert after.get_state() == {"skipped": 2, "in_a_row": 2, "first": 2.0}
    metrics = {"loss": float("nan"), "skipped": 1.0}
    with pytest.raises(TrainingDiverged, match=r"^training diverged: 3 steps in a row were skipped"):
        after(actions.StepEvent(4, metrics, None, None, False))
    assert metrics["skipped_steps"] == 3.0


def json_roundtrip(value):
    import json
    return json.loads(json.dumps(value))


def test_without_skipping_a_non_finite_update_stops_the_run_before_it_is_checkpointed(tmp_path):
    trainer = trainer_for("mlp", "2x4", optimizer=optax.sgd(float("inf")), skip_nonfinite=False)
    checkpoints = Checkpointer(str(tmp_path))
    with pytest.raises(jaxpar.FitError, match=r"^training diverged: the update of step 1 is not finite \(its loss "
                                              r"2\.\d+ was\); lower the learning rate$"):
        trainer.fit(trainer.init(0), nan_batches(set()), 3,
                    actions=[actions.StopIfDiverged(), actions.Checkpoint(checkpoints, every=1)])
    checkpoints.wait()
    assert checkpoints.steps() == []
