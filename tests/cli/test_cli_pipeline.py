"""run.py's pipeline flags: --pipeline, --microbatches, --repeats (issue 19). Declared like every option; each bad
combination is one stderr line and exit code 2 before anything trains; one tiny pipelined run end to end."""

import subprocess
import sys

import pytest

import jaxpar
import run
from jaxpar.cli import build as build_lib
from jaxpar.cli.config import OPTIONS, Config
from jaxpar.cli.flags import FLAGS
from jaxpar.cli.help import describe
from jaxpar.cli.notes import run_notes
from tests.helpers import child_env
from tests.cli.test_cli import ROOT

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--d-ff", "64", "--seq-len", "16", "--batch-size", "8",
        "--steps", "1"]


def fails(argv, capsys, contains: str) -> str:
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("run.py: error: "), err
    assert contains in err, err
    assert "Traceback" not in err
    return err


# --- declared like every option ------------------------------------------------------------------------------------
def test_the_flags_are_config_fields_in_the_pipeline_group():
    assert [f.flag for f in FLAGS if f.group == "pipeline"] == ["--pipeline", "--microbatches", "--repeats"]
    assert run.parse([]).pipeline == "gpipe" and run.parse([]).microbatches == 1 and run.parse([]).repeats == 1
    config = run.parse(["--mesh", "data=2,stage=2,model=2", "--layers", "4", "--pipeline", "1f1b",
                        "--microbatches", "4"])
    assert (config.pipeline, config.microbatches, config.repeats, config.layers) == ("1f1b", 4, 1, 4)
    config = run.parse(["--mesh", "stage=2", "--layers", "4", "--pipeline", "circular", "--repeats", "2",
                        "--microbatches", "2"])
    assert (config.pipeline, config.microbatches, config.repeats) == ("circular", 2, 2)
    for name in ("pipeline", "microbatches", "repeats"):
        assert OPTIONS[name].group == "pipeline" and OPTIONS[name].checks
    assert "gpipe | circular | 1f1b" in describe("pipeline") and "default: gpipe" in describe("pipeline")
    assert "default: 1" in describe("microbatches") and "--grad-accum" in describe("microbatches")
    assert "--pipeline circular" in describe("repeats") and "default: 1" in describe("repeats")


def test_the_config_record_keeps_them():
    config = Config(mesh="stage=2", layers=4, pipeline="circular", microbatches=2, repeats=2)
    record = config.to_record()
    assert (record["pipeline"], record["microbatches"], record["repeats"]) == ("circular", 2, 2)
    assert Config.from_record(record) == config.resolved()
    old = {k: v for k, v in record.items() if k not in ("pipeline", "microbatches", "repeats")}  # an older run's
    assert Config.from_record(old).pipeline == "gpipe" and Config.from_record(old).microbatches == 1


def test_build_hands_the_pipeline_to_the_trainer(monkeypatch, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some text to train on. " * 400)
    seen = {}

    class Stop(Exception):
        pass

    def trainer(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(build_lib, "Trainer", trainer)
    config = run.parse(["--mesh", "stage=2", "--data", str(text), *TINY, "--pipeline", "1f1b", "--microbatches", "2"])
    with pytest.raises(Stop):
        build_lib.build(config)
    assert seen["pipeline"] == jaxpar.pipeline.Pipeline("1f1b", 2, 1)


# --- one line, exit code 2 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--pipeline", "pipedream"], "--pipeline 'pipedream' is not a pipeline schedule; choose one of gpipe, circular, "
                                  "1f1b"),
    (["--microbatches", "0"], "--microbatches 0: must be an integer >= 1"),
    (["--repeats", "0"], "--repeats 0: must be an integer >= 1"),
    (["--repeats", "2"], "--repeats 2 applies only to --pipeline circular (got gpipe); add --pipeline circular, or "
                         "drop --repeats"),
    (["--repeats", "2", "--pipeline", "1f1b", "--mesh", "stage=2"], "--repeats 2 applies only to --pipeline circular "
                                                                    "(got 1f1b)"),
    (["--mesh", "stage=2", "--layers", "3"], "--layers 3 does not divide by the stage axis of size 2 (--mesh stage=2)"
                                             ": each stage runs an equal run of layers; use a multiple of 2 for "
                                             "--layers, or a stage axis that divides 3 (e.g. stage=1)"),
    (["--mesh", "data=2,stage=4", "--layers", "6"], "--layers 6 does not divide by the stage axis of size 4"),
    (["--mesh", "stage=2", "--layers", "2", "--pipeline", "circular", "--repeats", "2", "--microbatches", "2"],
     "--repeats 2: --layers 2 does not split into 2 stages x 2 repeats (--pipeline circular, --mesh stage=2); use a "
     "multiple of 4 for --layers, or --repeats 1"),
    (["--mesh", "stage=2", "--layers", "6", "--pipeline", "circular", "--repeats", "3", "--microbatches", "2"], None),
    (["--mesh", "stage=4", "--layers", "8", "--pipeline", "circular", "--repeats", "2", "--microbatches", "2"],
     "--microbatches 2 with --pipeline circular --repeats 2 on 4 stages: a round of microbatches must be back at "
     "stage 0 before it is due, so the circular schedule needs at least as many microbatches as stages; use "
     "--microbatches 4 or more"),
])
def test_bad_pipeline_settings_are_one_config_error(args, message, capsys):
    """Caught by validation, before any device or data: `Config.validate()` and run.py say the same line."""
    if message is None:  # 6 layers on 2 stages x 3 repeats: fine
        run.parse(args)
        return
    fails(args, capsys, message)
    with pytest.raises(jaxpar.JaxparError) as raised:
        run.parse(args)
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("args, message", [
    # sync: the stack cuts the global batch / K; M must divide each replica's share
    (["--mesh", "data=2", "--microbatches", "3"], "--microbatches 3 does not divide the 4 rows per replica that the "
                                                  "stacked layers cut (--batch-size 8 / 2 replicas); use a divisor of "
                                                  "4, e.g. --microbatches 2"),
    (["--mesh", "data=2,stage=2", "--grad-accum", "2", "--microbatches", "4"],
     "--microbatches 4 does not divide the 2 rows per replica that the stacked layers cut (--batch-size 8 / 2 "
     "replicas / --grad-accum 2); use a divisor of 2, e.g. --microbatches 2"),
    (["--mesh", "stage=2", "--microbatches", "16"], "--microbatches 16 does not divide the 8 rows per replica that "
                                                    "the stacked layers cut (--batch-size 8); use a divisor of 8, e.g. "
                                                    "--microbatches 8"),
    # inside a replica (local SGD): one replica's batch / K
    (["--mesh", "data=4", "--strategy", "local_sgd", "--microbatches", "4"], "--microbatches 4 does not divide the 2 "
                                                                             "rows per replica"),
    # every --batch-ramp size that runs
    (["--mesh", "data=2", "--batch-ramp", "8:0,12:1", "--steps", "2", "--microbatches", "4"],
     "--microbatches 4 does not divide the 6 rows per replica that the stacked layers cut (--batch-ramp 12 / 2 "
     "replicas); use a divisor of 6, e.g. --microbatches 3"),
])
def test_microbatches_must_divide_the_per_replica_batch(args, message, capsys):
    """Checked with the batch sizes, before the data is read (the data path here does not exist)."""
    fails(["--data", "/nonexistent/corpus.txt", *TINY, *args], capsys, message)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_a_model_without_stacked_layers_on_a_stage_mesh_is_the_partitioners_one_line(model, capsys):
    fails(["--model", model, "--mesh", "stage=2", "--steps", "1"], capsys,
          "mesh stage=2: the model has no stacked layers to split over stages")
    fails(["--model", model, "--mesh", "data=2,stage=2", "--steps", "1", "--microbatches", "2"], capsys,
          "no stacked layers")


def test_a_stage_axis_of_minus_one_is_checked_once_the_mesh_exists(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("some text to train on. " * 400)
    run.parse(["--mesh", "stage=-1", "--layers", "3", "--data", str(text)])  # not known from the spec alone
    fails(["--mesh", "stage=-1", "--data", str(text), *TINY, "--layers", "3"], capsys,
          "--layers 3 does not divide by the stage axis of size 8 (--mesh stage=-1)")


# --- allowed, but said ---------------------------------------------------------------------------------------------
def test_settings_that_cannot_act_are_notes():
    notes = run_notes(run.parse(["--mesh", "2x4", "--pipeline", "circular", "--repeats", "2", "--microbatches", "2"]))
    assert notes == ["--pipeline circular, --repeats 2 on --mesh 2x4, which has no stage axis: nothing is pipelined, "
                     "the stacked layers run as one scan (--microbatches still cuts the batch); add e.g. stage=2 to "
                     "--mesh"]
    assert run_notes(run.parse(["--model", "mlp", "--mesh", "8", "--microbatches", "2"])) == [
        "--microbatches 2: --model mlp has no stacked layers (jaxpar.pipeline.Stack), so nothing is pipelined or "
        "microbatched"]
    assert run_notes(run.parse(["--mesh", "2x4", "--microbatches", "2"])) == []  # it cuts the batch: it acts
    assert run_notes(run.parse(["--mesh", "stage=2", "--pipeline", "1f1b"])) == []
    assert run_notes(run.parse([])) == []


# --- resume --------------------------------------------------------------------------------------------------------
def test_a_resumed_run_may_change_the_schedule_and_repeats_and_microbatches_without_dropout():
    saved = Config(mesh="stage=2", layers=4, pipeline="gpipe", microbatches=2).to_record()
    for changes in ({"pipeline": "1f1b"}, {"pipeline": "circular", "repeats": 2}, {"mesh": "2x4"}):
        assert Config(mesh="stage=2", layers=4, microbatches=2).replace(**changes).resume_differences(saved) == []
    now = Config(mesh="stage=2", layers=4, microbatches=4)
    assert now.resume_differences(saved) == [
        "--microbatches 4 (checkpoint: 2; with --dropout 0.1 it decides the dropout masks; free to change with "
        "--dropout 0)"]
    without_dropout = Config(mesh="stage=2", layers=4, microbatches=2, dropout=0.0).to_record()
    assert now.replace(dropout=0.0).resume_differences(without_dropout) == []
    mlp = Config(model="mlp", mesh="8", microbatches=2)  # nothing to microbatch: free
    assert mlp.replace(microbatches=4).resume_differences(mlp.to_record()) == []
    old = {k: v for k, v in saved.items() if k not in ("pipeline", "microbatches", "repeats")}  # an older checkpoint
    assert now.resume_differences(old) == []


# --- end to end ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_tiny_1f1b_run_on_two_stages_trains():
    done = subprocess.run([sys.executable, "run.py", "--mesh", "stage=2", "--model", "transformer", *TINY[:-2],
                           "--steps", "2", "--pipeline", "1f1b", "--microbatches", "2"], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "on mesh data=1 x stage=2 x fsdp=1 x seq=1 x model=1" in done.stdout and "step 2/2" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
