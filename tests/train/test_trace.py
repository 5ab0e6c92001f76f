"""Profiler traces: `jaxpar.Trace` (an action of `Trainer.fit`) and `run.py --profile START:STOP` write a
`jax.profiler` trace (`plugins/profile/<time>/<host>.xplane.pb`) whose steps carry the `jaxpar_step` marker; the
trace is stopped however fit ends; bad values are one line, exit code 2, nothing written."""

import itertools
import os

import jax
import pytest

import jaxpar
import run
from jaxpar.train import actions
from tests.helpers import batch_for, trainer_for
from tests.cli.test_cli_failures import fails


def batches():
    return (batch_for("mlp", seed=n % 3) for n in itertools.count())


def traces(folder) -> list[str]:
    return sorted(os.path.join(root, name) for root, _, names in os.walk(folder) for name in names
                  if name.endswith(".xplane.pb"))


def assert_traced(folder):
    found = traces(folder)
    assert len(found) == 1, found
    assert os.sep.join(("plugins", "profile")) in found[0]
    assert actions.STEP_MARKER.encode() in open(found[0], "rb").read()  # the step annotations are in the trace
    assert any(name == "perfetto_trace.json.gz" for name in os.listdir(os.path.dirname(found[0])))


def test_the_trace_action_traces_its_steps(tmp_path):
    trainer = trainer_for("mlp", "2x4")
    trace = jaxpar.Trace(2, 4, tmp_path / "trace")
    state = trainer.fit(trainer.init(0), batches(), 6, actions=[trace])
    assert int(state.step) == 6 and trace.written == [3, 4] and not trace.active
    assert_traced(tmp_path / "trace")


@pytest.mark.parametrize("how", ["last step before stop", "action error", "batches run out"])
def test_the_trace_is_stopped_when_fit_ends_early(tmp_path, how):
    trainer = trainer_for("mlp", "2x4")
    trace = jaxpar.Trace(1, 10, tmp_path / "trace")

    class Boom(jaxpar.Action):
        every = 3

        def __call__(self, event):
            raise RuntimeError("disk full")

    if how == "last step before stop":
        trainer.fit(trainer.init(0), batches(), 4, actions=[trace])
    else:
        source = [batch_for("mlp")] * 3 if how == "batches run out" else batches()
        with pytest.raises(jaxpar.FitError):
            trainer.fit(trainer.init(0), source, 6, actions=[trace] + ([Boom()] if how == "action error" else []))
    assert not trace.active and trace.written[0] == 2
    assert_traced(tmp_path / "trace")
    jax.profiler.start_trace(str(tmp_path / "again"))  # nothing left running: a new trace can start
    jax.profiler.stop_trace()


def test_bad_trace_steps_are_refused():
    for start, stop, words in ((-1, 3, "Trace(start=-1)"), (3, 3, "Trace(stop=3)"), (7, 3, "after start 7")):
        with pytest.raises(jaxpar.ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            jaxpar.Trace(start, stop, "unused")


def test_a_trace_that_cannot_start_is_a_fit_error_with_a_usable_state(tmp_path):
    trainer = trainer_for("mlp", "2x4")
    jax.profiler.start_trace(str(tmp_path / "other"))  # someone else's trace is running
    try:
        with pytest.raises(jaxpar.FitError, match=r"action Trace failed before step 2: RuntimeError: Profile has "
                                                  r"already been started") as info:
            trainer.fit(trainer.init(0), batches(), 4, actions=[jaxpar.Trace(1, 3, tmp_path / "trace")])
    finally:
        jax.profiler.stop_trace()
    assert info.value.step == 1 and int(info.value.state.step) == 1
    assert not traces(tmp_path / "trace")


# --- run.py --profile START:STOP --------------------------------------------------------------------------------
TINY_RUN = ["--model", "mlp", "--steps", "6", "--eval-batches", "0"]


@pytest.mark.slow
def test_run_profile_writes_a_trace_next_to_the_metrics_file(tmp_path, capsys):
    assert run.main(TINY_RUN + ["--profile", "2:4", "--metrics", str(tmp_path / "m.jsonl")]) == 0
    assert f"tracing steps 2 to 4 with jax.profiler into {tmp_path / 'profile' / 'plugins' / 'profile'}" in \
        capsys.readouterr().out
    assert_traced(tmp_path / "profile")


@pytest.mark.slow
def test_run_profile_writes_into_the_tensorboard_folder_or_the_profile_dir(tmp_path):
    assert run.main(TINY_RUN + ["--profile", "0:1", "--tensorboard", str(tmp_path / "tb")]) == 0
    assert_traced(tmp_path / "tb")  # `tensorboard --logdir tb` shows it in its profile tab
    assert run.main(TINY_RUN + ["--profile", "5:9", "--tensorboard", str(tmp_path / "tb2"), "--profile-dir",
                                str(tmp_path / "mine")]) == 0  # STOP after the last step: stopped at the end
    assert_traced(tmp_path / "mine") and not traces(tmp_path / "tb2")


@pytest.mark.parametrize("argv, contains", [
    (["--profile", "5"], "--profile '5': must be START:STOP, step numbers with 0 <= START < STOP"),
    (["--profile", "7:3"], "--profile '7:3': must be START:STOP"),
    (["--profile=-1:3"], "--profile '-1:3': must be START:STOP"),
    (["--profile", "2:2"], "e.g. --profile 2:4"),
    (["--profile-dir", "traces"], "--profile-dir 'traces': applies only with --profile; add e.g. --profile 2:4"),
    (["--profile", "2:4", "--profile-dir", "a-file"], "--profile-dir 'a-file': is a regular file, not a folder"),
    (["--profile", "2:4", "--profile-dir", "missing/traces"], "--profile-dir 'missing/traces': folder "),
    (["--profile", "2:4", "--metrics", "sub/m.jsonl"], "--profile 2:4: its default --profile-dir 'sub/profile': "
                                                         "is a regular file, not a folder"),
    (["--model", "transformer", "--profile", "2:4", "--data", "sub", "--profile-dir", "sub/t"],
     "--profile-dir 'sub/t': is --data 'sub' or inside it"),
])
def test_bad_profile_values_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys, argv, contains):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("keep")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "profile").write_text("keep")
    fails(TINY_RUN + argv, capsys, contains=contains)
    assert sorted(os.listdir(tmp_path)) == ["a-file", "sub"] and os.listdir(tmp_path / "sub") == ["profile"]
