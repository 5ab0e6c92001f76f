"""run.py with checkpoints: a run killed with SIGKILL and resumed is bit-identical to one never interrupted (sync,
local SGD killed between meetings, SSP killed mid-schedule; batches read ahead or not, 2 or 3 ahead); SIGTERM saves and exits 0; --resume's refusals.

The killed run is a real process; the uninterrupted and the resumed runs run in-process (`run.main`)."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import run
from jaxpar.io.checkpoint import MANIFEST, Checkpointer
from tests.helpers import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--model", "mlp", "--mesh", "2x4", "--log-every", "1", "--eval-batches", "0", "--lr", "0.01"]
STEPS = 12


def records(path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, open(path).read().splitlines()) if "step" in r and "loss" in r}


def start(args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "run.py", *args], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(predicate, process, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"gave up waiting (exit code {process.returncode}): {process.stderr.read()[-2000:]}")
        time.sleep(0.05)


@pytest.mark.slow
# each case's state holds the plain sync / local SGD state and more, so those two are not separate cases
@pytest.mark.parametrize("strategy", [
    ["--strategy", "ssp", "--staleness", "2", "--stragglers", "1:2.0"],  # checkpoint mid-schedule
    ["--allreduce", "ring", "--compress", "int8"],  # error-feedback residuals, one per replica
    ["--allreduce", "psum", "--compress", "powersgd:2"],  # residuals and the warm-start Q
    # meetings' outer gradients compressed; checkpoint at 4 and 8, between the meetings at 3, 6, 9, with non-zero
    # residuals
    ["--strategy", "local_sgd", "--sync-period", "3", "--compress", "int8"],
    ["--strategy", "diloco", "--sync-period", "3", "--compress", "powersgd:2"],
], ids=["ssp", "int8", "powersgd", "local_sgd-int8", "diloco-powersgd"])
def test_sigkill_then_resume_is_bit_identical_to_an_uninterrupted_run(strategy, tmp_path, capsys):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    # uninterrupted, each batch built in the step's thread (and `--resume` on an empty folder starts fresh, saying so)
    code = run.main([*BASE, *strategy, "--steps", str(STEPS), "--checkpoint-dir", str(whole), "--resume",
                     "--metrics", str(tmp_path / "whole.jsonl"), "--read-ahead", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"jaxpar: note: --resume: no checkpoint in {whole} yet: starting fresh" in out
    # killed with SIGKILL once the checkpoint of step 4 is complete (a later save may be half-written); it reads 2
    # batches ahead (the default), and the resumed run 3: the read-ahead is free to change at a resume
    process = start([*BASE, *strategy, "--steps", "100000", "--checkpoint-dir", str(killed), "--checkpoint-every",
                     "4"])
    wait_for(lambda: (killed / "4").is_dir(), process)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    saved = Checkpointer(str(killed)).steps()
    assert saved and saved[0] == 4, saved
    code = run.main([*BASE, *strategy, "--steps", str(STEPS), "--checkpoint-dir", str(killed), "--resume",
                     "--metrics", str(tmp_path / "resumed.jsonl"), "--read-ahead", "3"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"resumed at step {saved[-1]}" in out
    expected, resumed = records(tmp_path / "whole.jsonl"), records(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == list(range(saved[-1] + 1, STEPS + 1))
    for step in resumed:
        assert resumed[step]["loss"] == expected[step]["loss"], (step, saved, resumed[step], expected[step])
    a, b = Checkpointer(str(whole)).arrays(STEPS), Checkpointer(str(killed)).arrays(STEPS)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sigterm_saves_a_durable_checkpoint_and_exits_0(tmp_path):
    folder, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    process = start([*BASE, "--steps", "100000", "--checkpoint-dir", str(folder), "--checkpoint-every", "1000",
                     "--metrics", str(metrics)])
    wait_for(lambda: metrics.parent.glob(".m.jsonl.*") and any(
        '"step": 2' in p.read_text() for p in tmp_path.glob(".m.jsonl.*")), process)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err[-2000:]
    step = int(err.split("run.py: stopped at step ")[1].split(";")[0])
    assert err.endswith(f"run.py: stopped at step {step}; its checkpoint is saved: continue with --resume\n")
    assert Checkpointer(str(folder)).steps() == [step] and (folder / str(step) / MANIFEST).exists()
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert lines[-1] == {"stopped": f"preempted: checkpoint of step {step} saved"}
    # resumed with the same --metrics: one continuous file (the stop record dropped, a second config record)
    assert run.main([*BASE, "--steps", str(step + 2), "--checkpoint-dir", str(folder), "--resume", "--metrics",
                     str(metrics)]) == 0
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, step + 3))
    assert [r.get("resumed_from") for r in lines if "versions" in r] == [None, step]
    assert not any("stopped" in r for r in lines)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    folder = tmp_path_factory.mktemp("finished")
    assert run.main([*BASE, "--steps", "3", "--checkpoint-dir", str(folder)]) == 0
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--lr", "0.02", "--hidden", "64"], "the checkpoint of step 3 was written with another config: --hidden 64 "
                                         "(checkpoint: 128), --lr 0.02 (checkpoint: 0.01); resume with the "
                                         "checkpoint's values, or start a fresh run in another folder"),
    (["--resume-step", "2"], "has no checkpoint of step 2; it has steps 3"),
    (["--steps", "3"], "its checkpoint of step 3 is already at or past --steps 3; pass a larger --steps to train on"),
])
def test_resume_refusals_name_the_folder_and_what_differs(finished, args, message, capsys):
    argv = [*BASE, "--steps", "6", "--checkpoint-dir", str(finished), "--resume", *args]
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"run.py: error: --checkpoint-dir {str(finished)!r}: {message}\n"


@pytest.mark.parametrize("args, message", [
    (["--resume"], "--resume auto: needs --checkpoint-dir (the folder to resume from)"),
    (["--resume-step", "3"], "--resume-step 3: applies only with --resume; add --resume"),
    (["--checkpoint-dir", "/proc/version"], "--checkpoint-dir '/proc/version': is a regular file, not a folder"),
    (["--on-nonfinite", "ignore"], "--on-nonfinite 'ignore': choose one of skip, abort"),
])
def test_checkpoint_flag_errors(args, message, capsys):
    assert run.main([*BASE, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"run.py: error: {message}") and err.count("\n") == 1


def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused(finished, capsys):
    assert run.main([*BASE, "--checkpoint-dir", str(finished)]) == 2
    assert capsys.readouterr().err == (f"run.py: error: --checkpoint-dir {str(finished)!r}: already holds checkpoints "
                                       f"of another run (steps 3); pass --resume to continue it, or use an empty "
                                       f"folder\n")


def test_resume_step_on_an_empty_folder_is_refused(tmp_path, capsys):
    assert run.main([*BASE, "--checkpoint-dir", str(tmp_path), "--resume", "--resume-step", "5"]) == 2
    assert "holds no checkpoint to resume from" in capsys.readouterr().err


def test_resume_required_refuses_an_empty_folder_and_creates_none(tmp_path, capsys):
    folder = tmp_path / "new"
    assert run.main([*BASE, "--checkpoint-dir", str(folder), "--resume", "required"]) == 2
    assert capsys.readouterr().err == (f"run.py: error: --checkpoint-dir {str(folder)!r}: holds no checkpoint to "
                                       f"resume from (--resume required); run without --resume to start fresh\n")
    assert not folder.exists()  # a run that saved nothing leaves no folder behind


@pytest.mark.slow
def test_superseded_checkpoints_are_never_replaced(tmp_path, capsys):
    """Resuming an older step twice (the first time with another strategy): each set-aside step 4 is kept."""
    folder = tmp_path / "ckpt"
    common = [*BASE, "--steps", "4", "--checkpoint-dir", str(folder), "--checkpoint-every", "2"]
    assert run.main(common) == 0
    assert run.main([*common, "--resume", "--resume-step", "2", "--strategy", "local_sgd", "--sync-period", "2"]) == 0
    out, _ = capsys.readouterr()
    aside = folder / "superseded"
    assert (f"jaxpar: note: checkpoints of steps 4 are newer than the resumed step 2: moved to {aside / '4'} (not "
            f"deleted)") in out
    assert run.main([*common, "--resume", "--resume-step", "2"]) == 0
    out, _ = capsys.readouterr()
    assert (f"jaxpar: note: checkpoints of steps 4 are newer than the resumed step 2: moved to {aside / '4.1'} (not "
            f"deleted)") in out
    strategies = {name: json.load(open(aside / name / "meta" / "metadata"))["strategy"] for name in ("4", "4.1")}
    assert strategies == {"4": "sync", "4.1": "local_sgd"}  # the first one set aside is still there, as it was
    assert sorted(os.listdir(aside)) == ["4", "4.1"]


@pytest.mark.slow
def test_a_folder_that_is_not_a_checkpoint_gets_one_line_and_no_orbax_warnings(tmp_path):
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "notes.txt").write_text("not a checkpoint")
    result = subprocess.run([sys.executable, "run.py", *BASE, "--steps", "8", "--checkpoint-dir", str(tmp_path),
                             "--resume"], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "absl" not in result.stderr + result.stdout and "Metadata file" not in result.stderr + result.stdout
    assert result.stderr.startswith(f"run.py: error: --checkpoint-dir {str(tmp_path)!r}: the checkpoint of step 5 "
                                    f"is unusable: ") and result.stderr.count("\n") == 1, result.stderr
