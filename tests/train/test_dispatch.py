"""The host side of `Trainer.step` / `dispatch`: per call, no read back from the device and no batch check after
the first batch of a structure (benchmarks/overhead.py measures what that buys)."""

import jax
import pytest

import jaxpar
from tests.helpers import batch_for, trainer_for


def test_step_numbers_are_counted_on_the_host_without_reading_the_state(monkeypatch):
    trainer = trainer_for("mlp", "2x4")
    batch = trainer.shard_batch(batch_for("mlp", 16))
    state = trainer.init(0)
    state, first = trainer.step(state, batch)  # a state the trainer did not return: read once
    reads = []
    real = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: reads.append(x) or real(x))
    times = []
    for _ in range(3):
        state, metrics = trainer.step(state, batch)
        times.append(metrics["sim_time"])
    assert reads == []
    monkeypatch.undo()
    assert int(state.step) == 4
    assert times == [trainer.clock.time_after(trainer.num_replicas, n) for n in (1, 2, 3)]
    assert first["sim_time"] == trainer.clock.time_after(trainer.num_replicas, 0)


@pytest.mark.slow
def test_a_restored_or_foreign_state_is_read_not_guessed():
    trainer = trainer_for("mlp", "2x4", strategy=jaxpar.SSP(1, horizon=8))
    batch = batch_for("mlp", 16)
    state, _ = trainer.step(trainer.init(0), batch)
    state, _ = trainer.step(state, batch)
    other, metrics = trainer.step(trainer.init(1), batch)  # step 0 again: its own number, not 2
    assert float(metrics["sim_time"]) == trainer.clock.time_after(trainer.num_replicas, 0)
    assert int(other.step) == 1


def test_a_batch_is_checked_once_per_structure_and_a_new_one_is_still_refused(monkeypatch):
    trainer = trainer_for("mlp", "2x4")
    checks = []
    real = trainer.batches.check
    monkeypatch.setattr(trainer.batches, "check", lambda batch: checks.append(1) or real(batch))
    state = trainer.init(0)
    for seed in range(3):
        state, _ = trainer.step(state, batch_for("mlp", 16, seed=seed))
    assert len(checks) == 1
    bad = batch_for("mlp", 16)
    bad["image"] = bad["image"][:15]  # a new structure: checked, and refused
    with pytest.raises(jaxpar.DataError, match=r"leading example dimension"):
        trainer.step(state, bad)
    assert len(checks) == 2
