"""Checkpoints written by jaxpar before the package reshape (tests/data/checkpoint_v1, see its reference.json) are
read as they were written and resume to the same losses: the on-disk format did not change."""

import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest

import jaxpar
import models
import run
from jaxpar.cli import Config
from jaxpar.io.checkpoint import Checkpointer

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "checkpoint_v1")
REFERENCE = json.load(open(os.path.join(DATA, "reference.json")))
KINDS = sorted(REFERENCE["commands"])  # local_sgd, sync
# The reference losses were written by a plain `python run.py` (XLA:CPU's default optimisation level); the tests
# compile with --xla_backend_optimization_level=0 (conftest.py), whose machine code may round differently in the
# last bits (no fused multiply-adds). Measured on this machine: no difference at all (0.0 for both steps of both
# checkpoints). 1e-6 (a few float32 ulps of a loss near 2.3) allows another CPU's rounding and still fails for any
# change of the restored state or of the math (one optimizer step changes the loss by about 1e-2).
RTOL = 1e-6


def copied(kind, tmp_path) -> str:
    folder = str(tmp_path / kind)
    shutil.copytree(os.path.join(DATA, kind), folder)
    return folder


def resume_args(kind: str, folder: str, metrics: str, steps: int = 5) -> list[str]:
    """reference.json's command for `kind`, writing into `folder`, resumed to `steps` with a metrics file."""
    args = REFERENCE["commands"][kind].split()[2:]  # without "python run.py"
    args[args.index("DIR")] = folder
    args[args.index("--steps") + 1] = str(steps)
    return [*args, "--resume", "--metrics", metrics]


def losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(path).read().splitlines()) if "step" in r and "loss" in r}


@pytest.mark.parametrize("kind", KINDS)
def test_the_arrays_of_an_old_checkpoint_read_exactly(kind):
    expected = np.load(os.path.join(DATA, f"{kind}_arrays.npz"))
    arrays = Checkpointer(os.path.join(DATA, kind)).arrays(3)
    assert sorted(arrays) == sorted(expected.files)
    for name in expected.files:
        assert arrays[name].dtype == expected[name].dtype and np.array_equal(arrays[name], expected[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_an_old_checkpoint_resumes_to_the_same_losses(kind, tmp_path, capsys):
    folder = copied(kind, tmp_path)
    code = run.main(resume_args(kind, folder, str(tmp_path / "m.jsonl")))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "resumed at step 3" in out
    got = losses(tmp_path / "m.jsonl")
    want = REFERENCE["resumed_to_step_5_losses"][kind]
    assert sorted(got) == [4, 5]
    for step in (4, 5):
        np.testing.assert_allclose(got[step], want[str(step)], rtol=RTOL, err_msg=f"{kind} step {step}")
    print(f"{kind}: relative differences", {s: abs(got[s] - want[str(s)]) / abs(want[str(s)]) for s in (4, 5)})


AVERAGED = "the 4 replicas' parameters, optimizer and BatchNorm states were averaged, as at a meeting"


@pytest.mark.slow
@pytest.mark.parametrize("flags, note", [
    (["--mesh", "8"], f"this run is local_sgd on 8 replicas: {AVERAGED}"),
    (["--strategy", "sync"], f"this run is sync on 4 replicas: {AVERAGED}; strategy state of the new strategy "
                             f"starts fresh"),
], ids=["8_replicas", "sync"])
def test_the_old_local_sgd_checkpoint_restores_onto_another_replica_count_and_strategy(flags, note, tmp_path, capsys):
    folder = copied("local_sgd", tmp_path)
    args = resume_args("local_sgd", folder, str(tmp_path / "m.jsonl"))
    for flag, value in zip(flags[::2], flags[1::2]):
        args[args.index(flag) + 1] = value
    if "sync" in flags:  # local SGD's period does not apply to sync
        del args[args.index("--sync-period"):args.index("--sync-period") + 2]
    code = run.main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"jaxpar: note: checkpoint step 3 was written by local_sgd on 4 replicas; {note}\n" in out
    got = losses(tmp_path / "m.jsonl")
    assert sorted(got) == [4, 5] and all(np.isfinite(v) for v in got.values())


def test_the_old_local_sgd_checkpoint_is_averaged_onto_8_replicas():
    """Through the library: every one of the 8 new replicas starts from the mean of the 4 saved ones."""
    saved = np.load(os.path.join(DATA, "local_sgd_arrays.npz"))
    config = Config(model="mlp", hidden=16)
    # run.py's optimizer structure: adamw with a schedule (its state: adam's, weight decay's, the schedule's count)
    trainer = jaxpar.Trainer(model=models.factory(config), loss_fn=models.LOSSES["mlp"],
                             optimizer=optax.adamw(optax.constant_schedule(3e-3)), mesh=jaxpar.make_mesh("8"),
                             strategy=jaxpar.LocalSGD(period=2))
    state, meta, notes = Checkpointer(os.path.join(DATA, "local_sgd")).restore(trainer)
    assert meta["strategy"] == "local_sgd" and meta["replicas"] == 4 and len(notes) == 1
    replicas = jax.device_get(state.strategy_state["params"])
    for name, leaf in (("hidden.kernel.value", replicas["hidden"]["kernel"].value),
                       ("out.bias.value", replicas["out"]["bias"].value)):
        mean = saved[f"strategy_state.params.{name}"].mean(axis=0, dtype=np.float32)
        assert leaf.shape == (8, *mean.shape)
        np.testing.assert_allclose(leaf, np.broadcast_to(mean, leaf.shape), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(jax.device_get(state.step), saved["step"])
