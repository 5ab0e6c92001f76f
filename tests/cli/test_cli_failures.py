"""Bad inputs and ways a run ends: one stderr line, exit code 2 (143 for SIGTERM), nothing lost or half-written.

Most cases fail before training, in-process (`run.main`); SIGTERM needs a real process.
"""

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import jaxpar
import run
from jaxpar.train import actions
from jaxpar.io import data
from jaxpar.cli.config import Config
from jaxpar.cli.batching import batch_sizes
from jaxpar.cli.notes import run_notes
from jaxpar.cli.strategies import from_config as strategy_from_config
from jaxpar.io.metrics import JsonlFile, RunLogger
from jaxpar.train.lr_schedules import batch_size_fn, lr_schedule, parse_batch_ramp
from jaxpar.strategies.stragglers import parse_stragglers
from tests.helpers import clock_times, child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP = ["--model", "mlp", "--mesh", "8"]


def fails(argv, capsys, *, contains: str) -> str:
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("run.py: error: "), err
    assert contains in err, err
    assert "Traceback" not in err
    return err


def leftovers(folder) -> list[str]:
    return [n for n in os.listdir(folder) if n.endswith(".tmp")]


def metrics_file(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"versions": {}}, *records]))
    return path.read_text()


# --- 1. data loss ------------------------------------------------------------------------------------------------
def test_metrics_on_the_data_file_or_inside_the_data_folder_is_refused(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("hello world " * 1000)
    link = tmp_path / "link.jsonl"
    link.symlink_to(text)
    for metrics in (text, link):
        fails(["--data", str(text), "--metrics", str(metrics)], capsys, contains="is --data")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.txt").write_text("some text " * 1000)
    fails(["--data", str(tmp_path / "folder"), "--metrics", str(tmp_path / "folder" / "m.jsonl")], capsys,
          contains="or inside it")
    assert text.read_text() == "hello world " * 1000 and not leftovers(tmp_path)


def test_metrics_on_the_config_file_is_refused(tmp_path, capsys):
    config = tmp_path / "cfg.py"
    body = "import jaxpar\ndef get_config():\n    return jaxpar.Config(model='mlp')\n"
    config.write_text(body)
    fails(["--config", str(config), "--metrics", str(config)], capsys, contains="is the --config file")
    assert config.read_text() == body


def test_empty_metrics_path_and_an_existing_file_that_is_not_a_metrics_file(tmp_path, capsys):
    fails(["--metrics", ""], capsys, contains="--metrics '': empty path; pass a file name such as run.jsonl")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    fails(["--metrics", str(notes)], capsys, contains="exists and is not a jaxpar metrics file")
    assert notes.read_text() == "my notes\n"


def test_an_existing_metrics_file_survives_a_run_that_fails_before_training(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    before = metrics_file(metrics, {"step": 1, "loss": 2.0})
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    fails(["--data", str(empty), "--metrics", str(metrics)], capsys, contains="contains no text")
    assert metrics.read_text() == before and not leftovers(tmp_path)


@pytest.mark.slow
def test_a_run_that_ends_in_an_error_keeps_a_complete_strict_jsonl(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    metrics_file(metrics, {"step": 1, "loss": 2.0})  # an earlier run's file: replaced, not appended to
    err = fails([*MLP, "--steps", "5", "--log-every", "1", "--optimizer", "sgd", "--lr", "1e30", "--on-nonfinite", "abort", "--metrics",
                 str(metrics)], capsys, contains="training diverged")
    lines = metrics.read_text().splitlines()
    records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}")) for line in lines]
    assert records[0]["lr"] == 1e30 and records[1]["step"] == 1
    assert records[-1] == {"stopped": err.strip().removeprefix("run.py: error: ")}
    assert not leftovers(tmp_path)


# --- 2. metrics paths that cannot really be written ----------------------------------------------------------------
@pytest.mark.parametrize("path, contains", [
    ("/dev/full", "is a character device, not a regular file"),
    ("/dev/null", "is a character device, not a regular file"),
    ("/proc/jaxpar-metrics.jsonl", "--metrics '/proc/jaxpar-metrics.jsonl': "),
    ("/sys/jaxpar-metrics.jsonl", "--metrics '/sys/jaxpar-metrics.jsonl': "),
    ("/proc/version", "exists and is not a jaxpar metrics file"),
])
def test_metrics_paths_that_fail_on_write_are_refused_before_training(path, contains, capsys):
    fails([*MLP, "--steps", "1", "--metrics", path], capsys, contains=contains)


def test_dangling_symlink_and_fifo_as_metrics_are_refused(tmp_path, capsys):
    link = tmp_path / "m.jsonl"
    link.symlink_to(tmp_path / "gone" / "m.jsonl")
    fails(["--metrics", str(link)], capsys, contains="is a dangling symbolic link")
    os.mkfifo(tmp_path / "pipe")
    fails(["--metrics", str(tmp_path / "pipe")], capsys, contains="is a named pipe (FIFO), not a regular file")


def test_jsonl_file_probe_names_the_flag_when_the_folder_refuses_files():
    with pytest.raises(jaxpar.JaxparError, match=r"--metrics '/proc/x.jsonl': cannot create a file in '/proc'"):
        JsonlFile("/proc/x.jsonl")


# --- 3. non-finite and absurd numbers ---------------------------------------------------------------------------
@pytest.mark.parametrize("args, contains", [
    (["--lr", "inf"], "--lr inf: must be a finite number; e.g. --lr 0.003"),
    (["--lr", "1e400"], "--lr inf: must be a finite number"),
    (["--weight-decay", "nan"], "--weight-decay nan: must be a finite number; e.g. --weight-decay 0.0"),
    (["--strategy", "diloco", "--outer-lr", "inf"], "--outer-lr inf: must be a finite number; e.g. --outer-lr 0.7"),
    (["--strategy", "asp", "--stragglers", "1:1e308"],
     "slowdown 1e308 of replica 1 must be a finite number > 0 and at most 1e+06"),
    (["--strategy", "asp", "--stragglers", "jitter=800"], "jitter 800 must be a finite number >= 0 and at most 10"),
    (["--strategy", "asp", "--stragglers", "jitter=1e308"], "jitter 1e308 must be a finite number >= 0 and at most 10"),
    (["--batch-ramp", "0:0"], "--batch-ramp '0:0': size 0 of the stage from step 0 is not a batch; use sizes >= 1"),
])
def test_non_finite_and_absurd_numbers_are_refused_up_front(args, contains, capsys):
    fails(args, capsys, contains=contains)


def test_jsonl_values_are_strict_json_with_null_for_non_finite(tmp_path):
    logger = RunLogger(1, 8, 1, str(tmp_path / "m.jsonl"), stream=open(os.devnull, "w"))
    logger.write({"versions": {}})
    logger.on_step(1, {"loss": float("nan"), "grad": float("inf")})
    logger.close()
    record = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[1])
    assert record["loss"] is None and record["grad"] is None and record["step"] == 1
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(tmp_path / "m.jsonl").st_mode & 0o777 == 0o666 & ~umask  # not the temporary file's 0600


# --- 4. values that must not allocate absurdly -----------------------------------------------------------------------
def test_lr_schedule_of_a_billion_steps_is_built_from_the_ramp_stages():
    size_at = batch_size_fn(32, parse_batch_ramp("32:0,64:100,128:500000000"))
    started = time.perf_counter()
    schedule = lr_schedule(0.1, 10 ** 9, scaling="linear", batch_at=size_at)
    assert time.perf_counter() - started < 1.0
    assert [float(schedule(s)) for s in (0, 99, 100, 499_999_999, 500_000_000, 10 ** 9 - 1)] == pytest.approx(
        [0.1, 0.1, 0.2, 0.2, 0.4, 0.4])


def test_the_simulated_clock_matches_a_clock_computed_by_hand_and_is_lazy():
    # 3 replicas, replica 1 twice as slow (compute 1, 2, 1 per step), unit compute, free communication.
    stragglers = parse_stragglers("1:2.0")
    # Period 1 (sync SGD): every step waits for replica 1, so the clock after step k is 2k.
    assert clock_times(jaxpar.Sync(stragglers=stragglers), 3, 5) == [2.0, 4.0, 6.0, 8.0, 10.0]
    # Period 3 (local SGD): in a round the replicas' clocks after each local step are (1, 2, 1), (2, 4, 2), (3, 6, 3).
    # Local steps report the mean: 4/3, 8/3; the meeting waits for the slowest: 6. The next round starts at 6:
    # (7, 8, 7) -> 22/3, (8, 10, 8) -> 26/3, meeting at 6 + 6 = 12.
    np.testing.assert_allclose(clock_times(jaxpar.LocalSGD(period=3, stragglers=stragglers), 3, 6),
                               [4 / 3, 8 / 3, 6.0, 22 / 3, 26 / 3, 12.0], rtol=0, atol=1e-12)
    # Post-local SGD: 2 sync steps (2, 4), then rounds of 3 from t = 4: means of (5, 6, 5) and (6, 8, 6), meeting at 10.
    post_local = jaxpar.LocalSGD(period=3, local_after=2, stragglers=stragglers)
    np.testing.assert_allclose(clock_times(post_local, 3, 5), [2.0, 4.0, 16 / 3, 20 / 3, 10.0], rtol=0, atol=1e-12)
    # Lazy: a run that never leaves its sync steps is produced step by step; its 100,000th step is at 2 x 100,000.
    started = time.perf_counter()
    endless = jaxpar.LocalSGD(period=3, local_after=10 ** 12, stragglers=stragglers).clock
    assert endless.time_after(3, 99_999) == 200_000.0 and time.perf_counter() - started < 20


def test_ssp_schedule_length_is_bounded_with_a_one_line_error(capsys):
    fails([*MLP, "--strategy", "ssp", "--steps", "1000000000"], capsys,
          contains="--steps 1000000000: too many for ssp / asp, whose schedule is simulated on the host up front "
                   "(at most 1,000,000 updates); use --steps 1000000 or fewer")


def test_staleness_and_local_after_beyond_the_run_are_capped_for_the_strategy():
    """The strategies plan max(--steps, 64) steps: the SSP buffer is min(S, max(steps, 64)) + 1 (so a resume that
    raises --steps within 64 keeps it) and post-local SGD's synchronous phase is cut to that length; the config
    record keeps the value given."""
    config = Config(model="mlp", strategy="ssp", staleness=20000, steps=5).resolved()
    assert strategy_from_config(config).buffer_size(4) == 65 and config.staleness == 20000
    assert strategy_from_config(config.replace(steps=100)).buffer_size(4) == 101
    assert strategy_from_config(config.replace(staleness=3)).buffer_size(4) == 4  # as given, whatever --steps
    local = Config(model="mlp", strategy="local_sgd", local_after=10 ** 12, steps=7).resolved()
    assert strategy_from_config(local).local_after == 64


@pytest.mark.slow
def test_huge_staleness_local_after_and_an_unreachable_ramp_stage_train(tmp_path, capsys):
    assert run.main([*MLP, "--strategy", "ssp", "--staleness", "20000", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "jaxpar: note: --staleness 20000 is larger than --steps 3" in out and "done: 3 steps" in out
    assert run.main([*MLP, "--strategy", "local_sgd", "--local-after", "1000000000000", "--batch-ramp",
                     "16:0,4096:1000", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "--local-after 1000000000000 is larger than --steps 3: the whole run is synchronous" in out
    assert "--batch-ramp stage(s) 4096:1000 start at or after --steps 3: never used" in out and "done: 3" in out


def test_unreachable_ramp_stages_are_not_checked():
    config = Config(model="mlp", mesh="8", batch_ramp="16:0,4097:1000", steps=5).resolved()
    assert batch_sizes(config, 8, 8) == [16]
    with pytest.raises(jaxpar.ConfigError, match="size 4097 does not divide"):
        batch_sizes(config.replace(steps=2000), 8, 8)


# --- 5. messages that say what is wrong --------------------------------------------------------------------------
def test_data_and_config_paths_that_are_not_files_say_what_they_are(tmp_path, capsys):
    fails(["--config", str(tmp_path)], capsys, contains="is a folder, not a file; pass a Python file")
    fails(["--data", "/dev/zero"], capsys, contains="--data '/dev/zero': is a character device, not a file or folder")
    os.mkfifo(tmp_path / "fifo")
    fails(["--data", str(tmp_path / "fifo")], capsys, contains="is a named pipe (FIFO), not a file or folder")
    fails(["--config", str(tmp_path / "fifo")], capsys, contains="is a named pipe (FIFO), not a file")


def test_config_file_without_py_extension_loads_and_huge_ints_are_refused(tmp_path, capsys):
    path = tmp_path / "preset.conf"
    path.write_text("import jaxpar\ndef get_config():\n    return jaxpar.Config(model='mlp', steps=7)\n")
    assert run.parse(["--config", str(path)]).steps == 7
    path.write_text("import jaxpar\ndef get_config():\n    return jaxpar.Config(lr=10**400)\n")
    err = fails(["--config", str(path)], capsys, contains="--lr 100000000000...(401 digits): too large for a float")
    assert len(err) < 200


# --- 6. divergence -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_divergence_names_the_flag_that_was_set(capsys):
    fails([*MLP, "--steps", "4", "--optimizer", "sgd", "--lr", "1e6", "--on-nonfinite", "abort"], capsys,
          contains="; lower --lr (it is 1e+06 with --optimizer sgd; try 10x smaller)")


def _event(step, loss):
    return actions.StepEvent(step, {"loss": loss}, None, None, False)


def test_an_exploding_finite_loss_is_divergence():
    stop = actions.StopIfDiverged(lambda loss, step: "lower --lr")
    for step, loss in enumerate([2.3, 5.0, 200.0, 900.0], 1):  # wanders up, stays under the 1e3 floor
        stop(_event(step, loss))
    with pytest.raises(jaxpar.errors.TrainingDiverged,
                       match=r"loss is 4.3e\+05 at step 5, over 100 x the first step's 2.3; lower --lr"):
        stop(_event(5, 4.3e5))


# --- 7. settings that cannot act within the run --------------------------------------------------------------------
def test_settings_beyond_the_run_are_one_line_notes():
    notes = run_notes(Config(strategy="local_sgd", steps=5, warmup_steps=10, sync_period=8, local_after=9,
                             eval_every=6, log_every=50))
    assert [n.split(" is larger")[0] for n in notes] == ["--warmup-steps 10", "--sync-period 8", "--local-after 9",
                                                         "--eval-every 6", "--log-every 50"]
    assert run_notes(Config(steps=5)) == [] and run_notes(Config(strategy="local_sgd", steps=3)) == []


# --- 9. binary data ----------------------------------------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_binary_data_trains_on_raw_bytes_with_a_note(tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\0" + bytes(range(1, 128)) * 64)  # ASCII, but with a NUL byte
    notes, seen = logging.getLogger("jaxpar"), _Records()
    notes.addHandler(seen)
    try:
        tokens = data.load_text(str(blob))
    finally:
        notes.removeHandler(seen)
    assert len(tokens) == 1 + 127 * 64
    assert [r.getMessage() for r in seen.records] == [
        f"--data {str(blob)!r} is not text (a NUL byte at offset 0); training on its raw bytes anyway"]
    invalid = np.frombuffer(b"caf\xc3\xa9 \xff", np.uint8)
    assert data.binary_note(invalid) == "is not UTF-8 text (invalid byte at offset 6)"
    assert data.binary_note(np.frombuffer("naïve text é"[:-1].encode() + "é".encode()[:1], np.uint8)) is None


# --- 10. SIGTERM -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_ends_the_run_like_ctrl_c_and_keeps_the_jsonl(tmp_path):
    metrics = tmp_path / "m.jsonl"
    env = child_env()
    process = subprocess.Popen([sys.executable, "run.py", *MLP, "--steps", "100000", "--log-every", "1",
                                "--metrics", str(metrics)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not lines.get(timeout=max(deadline - time.monotonic(), 0.1)).startswith("step 1/"):
            pass
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        err = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143 and err == "run.py: terminated\n", err
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[0]["steps"] == 100000 and records[1]["step"] == 1 and records[-1] == {"stopped": "terminated"}
    assert not leftovers(tmp_path)


def test_a_model_too_large_for_memory_is_refused_in_one_line_not_a_hang(capsys, tmp_path):
    """It used to wait forever in device_get(state.step) after the device failed to allocate the parameters."""
    metrics = tmp_path / "m.jsonl"
    assert run.main(["--model", "mlp", "--hidden", "4000000000", "--mesh", "8", "--metrics", str(metrics)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("run.py: error: the train state needs 3,600,000,000,152 bytes per device but a device has ")
    assert err.count("\n") == 1 and not metrics.exists()


@pytest.mark.parametrize("args, message", [
    (["--model", "mlp", "--mesh", "1x3"], "--hidden 128 does not divide by the model axis of size 3 (--mesh 1x3); use a "
                                          "multiple of 3 for --hidden"),
    (["--mesh", "1x3"], "--heads 4 does not divide by the model axis of size 3 (--mesh 1x3)"),
])
def test_a_model_dimension_that_does_not_divide_names_the_flag_not_the_logical_axis(args, message, capsys):
    assert run.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["--strategy", "ssp", "--stragglers", "9:2.0"], "--stragglers '9:2.0': replica 9 does not exist; the data axis "
                                                     "has size 4, so use replicas 0..3"),
    (["--allreduce", "torus2d", "--torus", "3"], "--torus 3: does not divide the data axis size 4; use one of: 1, 2, 4"),
])
def test_strategy_errors_found_against_the_mesh_name_the_flag(args, message, capsys):
    assert run.main(["--model", "mlp", "--mesh", "4x2", "--steps", "1", *args]) == 2
    err = capsys.readouterr().err
    assert err == f"run.py: error: {message}\n"


@pytest.mark.slow
def test_progress_output_says_what_is_true(capsys, tmp_path):
    """No sim_time without stragglers; no "at first" without a ramp; ASP without stragglers is said to be sync;
    SSP / ASP progress shows the contributing batch."""
    assert run.main(["--model", "mlp", "--mesh", "4x2", "--strategy", "asp", "--steps", "2", "--log-every", "1",
                     "--eval-batches", "0"]) == 0
    out = capsys.readouterr().out
    assert "(8 per replica)" in out and "at first" not in out
    assert "strategy asp without a straggler profile (--stragglers): every replica is equally fast" in out
    assert all("sim_time" not in line for line in out.splitlines() if line.startswith("step "))
    metrics = tmp_path / "m.jsonl"
    assert run.main(["--model", "mlp", "--mesh", "4x2", "--strategy", "asp", "--stragglers", "3:2.0", "--steps", "2",
                     "--log-every", "1", "--eval-batches", "0", "--metrics", str(metrics)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert "contributors 3" in lines[0] and "batch_size 24" in lines[0] and "sim_time 1" in lines[0]
    assert "contributors 4" in lines[1] and "batch_size 32" in lines[1]
    records = [json.loads(line) for line in metrics.read_text().splitlines()][1:]
    assert [r["batch_size"] for r in records[:2]] == [24.0, 32.0]


@pytest.mark.slow
def test_a_batch_ramp_recompile_is_labelled_in_the_record_that_pays_for_it(capsys, tmp_path):
    metrics = tmp_path / "m.jsonl"
    assert run.main(["--model", "mlp", "--mesh", "8", "--batch-ramp", "32:0,64:2", "--steps", "4", "--log-every", "1",
                     "--eval-batches", "0", "--metrics", str(metrics)]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()][1:5]
    assert [r.get("includes_compilation", False) for r in records] == [True, False, True, False]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert ["(includes compilation)" in line for line in lines] == [True, False, True, False]


def test_a_staleness_beyond_the_run_is_noted_with_the_buffer_the_strategy_keeps():
    """The note states the version buffer the strategy really allocates: it plans max(--steps, 64) updates, so
    --staleness 100 on a 10-step run keeps 65 versions, and on a 80-step run 81."""
    notes = run_notes(Config(model="mlp", strategy="ssp", staleness=100, steps=10).resolved())
    assert any(n.startswith("--staleness 100 is larger than --steps 10") and n.endswith("(the version buffer holds "
                                                                                         "65)") for n in notes), notes
    notes = run_notes(Config(model="mlp", strategy="ssp", staleness=100, steps=80).resolved())
    assert any(n.endswith("(the version buffer holds 81)") for n in notes), notes
