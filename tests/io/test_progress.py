"""Progress on the console: a live rich bar on a terminal, plain lines elsewhere; tokens/s for language models."""

import io
import json
from pathlib import Path

import pytest

from jaxpar.io.metrics import EVAL_PREFIX, RunLogger

# Every key a step record may hold besides the loss function's own metrics: docs/metrics.md, "The JSONL schema"
STEP_KEYS = {"step", "loss", "lr", "batch_size", "samples_per_sec", "elapsed_sec", "tokens_per_sec", "flops_per_sec",
             "flops_utilization", "includes_compilation", "sim_time", "skipped", "nonfinite", "skipped_steps",
             "replica_divergence", "staleness_mean", "staleness_max", "contributors", "version_buffer"}


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run_logger(stream, steps=5, **kw):
    logger = RunLogger(steps, 8, 2, stream=stream, **kw)
    for step in range(1, steps + 1):
        logger.on_step(step, {"loss": 2.0 / step})
    logger.close()
    return stream.getvalue()


def test_a_terminal_gets_a_bar_with_the_logged_lines_above_it():
    text = run_logger(Terminal(), tokens_per_example=16)
    assert "\x1b[" in text  # a live display (cursor control), not plain lines
    assert "step 1/5  loss 2" in text and "step 4/5  loss 0.5" in text and "step 5/5  loss 0.4" in text
    assert "step 3/5" not in text.replace("\x1b[32m", "")  # not a logged step: only the bar moved through it
    assert "5/5" in text and "tokens/s" in text and "eta 0s" in text


def test_pipes_and_files_get_plain_lines():
    text = run_logger(io.StringIO())
    assert "\x1b[" not in text
    assert [line.split("  ")[0] for line in text.splitlines()] == ["step 1/5", "step 2/5", "step 4/5", "step 5/5"]
    assert run_logger(Terminal(), progress="lines").count("\n") == 4  # asked for lines on a terminal


def test_tokens_per_second_is_recorded_for_a_language_model(tmp_path):
    path = tmp_path / "m.jsonl"
    logger = RunLogger(2, 8, 1, str(path), stream=io.StringIO(), tokens_per_example=128)
    logger.on_step(1, {"loss": 1.0})
    logger.on_step(2, {"loss": 0.5})
    logger.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(r["tokens_per_sec"] == pytest.approx(128 * r["samples_per_sec"]) for r in records)
    with pytest.raises(ValueError, match="progress 'fancy': choose auto, bar or lines"):
        RunLogger(1, 8, 1, progress="fancy")


@pytest.mark.slow
def test_tensorboard_event_files_hold_every_logged_number(tmp_path, capsys):
    import run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board, jsonl = tmp_path / "tb", tmp_path / "run.jsonl"
    assert run.main(["--model", "mlp", "--mesh", "2x4", "--steps", "6", "--log-every", "2", "--eval-every", "3",
                     "--tensorboard", str(board), "--metrics", str(jsonl)]) == 0
    capsys.readouterr()
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    events = EventAccumulator(str(board))  # TensorBoard's own reader
    events.Reload()
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert {e.step: e.value for e in events.Scalars("train/loss")} == pytest.approx(losses, rel=1e-6)
    evals = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
    assert sorted(evals) == [3, 6]
    assert {e.step: e.value for e in events.Scalars("eval/accuracy")} == pytest.approx(evals, rel=1e-6)
    assert {"train/samples_per_sec", "train/lr", "eval/loss"} <= set(events.Tags()["scalars"])


def test_a_tensorboard_path_that_is_a_file_is_one_line(tmp_path, capsys):
    import run

    (tmp_path / "file").write_text("x")
    assert run.main(["--model", "mlp", "--tensorboard", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--tensorboard" in err and "not a folder" in err, err


def test_steps_report_their_compiled_flops_and_the_log_their_utilisation():
    from tests.helpers import batch_for, trainer_for

    trainer = trainer_for("mlp", "1x1")  # 64 -> 32 -> 10, batch 64
    state, metrics = trainer.step(trainer.init(0), batch_for("mlp", size=64))
    # forward 2 x 64 x (64 x 32 + 32 x 10), backward twice that but without the input's gradient: the matmuls,
    # plus the elementwise work and the optimizer XLA counts too
    matmuls = 64 * (2 * (64 * 32 + 32 * 10) + 2 * (64 * 32 + 2 * 32 * 10))
    assert 1.0 <= metrics["flops"] / matmuls <= 1.2
    on_8 = trainer_for("mlp", "8x1")
    _, metrics_8 = on_8.step(on_8.init(0), batch_for("mlp", size=64))
    assert 0.9 <= metrics_8["flops"] / metrics["flops"] <= 1.5  # all devices together: about the same work


def test_flops_per_second_and_utilisation_are_recorded(tmp_path, monkeypatch):
    """FLOP/s = the FLOPs of the steps since the last record / the seconds since it, on a clock the test sets."""
    import types

    from jaxpar.io import metrics as metrics_lib
    from tests.helpers import batch_for, trainer_for

    trainer = trainer_for("mlp", "1x1")  # 64 -> 32 -> 10, batch 64: the hand count of test_steps_report_...
    _, compiled = trainer.step(trainer.init(0), batch_for("mlp", size=64))
    matmuls = 64 * (2 * (64 * 32 + 32 * 10) + 2 * (64 * 32 + 2 * 32 * 10))
    clock = [100.0]
    monkeypatch.setattr(metrics_lib, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    path = tmp_path / "m.jsonl"
    logger = RunLogger(4, 64, 3, str(path), stream=io.StringIO(), peak_flops=2e9)
    for step, at, flops in [(1, 102.0, 5e8), (2, 104.0, 5e8), (3, 107.0, 5e8), (4, 107.5, float(compiled["flops"]))]:
        clock[0] = at
        logger.on_step(step, {"loss": 1.0, "flops": flops})
    logger.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 3, 4]
    # step 1: 5e8 FLOPs in 2 s; steps 2 and 3 (step 2 not logged): 1e9 FLOPs in the 5 s since step 1's record
    assert [r["flops_per_sec"] for r in records[:2]] == [2.5e8, 2e8]
    assert [r["flops_utilization"] for r in records[:2]] == [0.125, 0.1]
    # step 4: the compiled step's FLOPs (XLA's count) in 0.5 s, against the hand count of its matmuls
    assert 1.0 <= records[2]["flops_per_sec"] / (matmuls / 0.5) <= 1.2


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [[], ["--strategy", "local_sgd", "--sync-period", "2"],
                                      ["--strategy", "diloco", "--sync-period", "2"],
                                      ["--strategy", "ssp", "--stragglers", "1:2.0"],
                                      ["--strategy", "asp", "--stragglers", "1:2.0"],
                                      ["--on-nonfinite", "abort", "--strategy", "sync", "--stragglers", "1:2.0"]],
                         ids=["sync", "local_sgd", "diloco", "ssp", "asp", "abort"])
def test_every_record_key_of_every_strategy_is_in_the_documented_schema(strategy, tmp_path, capsys):
    import run

    path = tmp_path / "m.jsonl"
    assert run.main(["--model", "mlp", "--mesh", "4x2", "--steps", "4", "--log-every", "1", "--eval-every", "2",
                     *strategy, "--metrics", str(path)]) == 0
    capsys.readouterr()
    records = [json.loads(line) for line in path.read_text().splitlines()][1:]
    own = {"accuracy"}  # the built-in loss functions' metric
    for record in records:
        if any(k.startswith(EVAL_PREFIX) for k in record):
            assert set(record) - {"step"} <= {EVAL_PREFIX + "loss", EVAL_PREFIX + "accuracy"}, record
        else:
            assert set(record) - own <= set(STEP_KEYS), set(record) - own - set(STEP_KEYS)
    keys = set().union(*records)
    expected = {"sync": {"skipped"}, "local_sgd": {"replica_divergence"}, "diloco": {"replica_divergence"},
                "ssp": {"staleness_mean", "staleness_max", "contributors", "version_buffer"},
                "asp": {"staleness_mean", "staleness_max", "contributors", "version_buffer"},
                "abort": {"nonfinite"}}
    name = strategy[strategy.index("--strategy") + 1] if "--strategy" in strategy else "sync"
    name = "abort" if "abort" in strategy else name
    assert expected[name] | {"sim_time", "flops_per_sec", "lr", "batch_size"} <= keys


def test_the_documented_schema_names_every_step_key():
    schema = Path(__file__).parents[2].joinpath("docs", "metrics.md").read_text().split("## The JSONL schema")[1]
    assert [k for k in sorted(STEP_KEYS) if f"`{k}`" not in schema and f"`{k}:" not in schema] == []
