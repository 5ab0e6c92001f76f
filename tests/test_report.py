"""`python -m jaxpar.report`: a PNG and a markdown table from JSONL files; bad input is one line."""

import json

import pytest

from jaxpar.io import report


def write_run(path, strategy, sim=False, stale=False, divergence=False, stopped=None):
    records = [{"mesh": "2x4", "model": "mlp", "strategy": strategy, "jaxpar": "0.1.0"}]
    for step in range(1, 11):
        record = {"step": step, "loss": 2.0 / step, "samples_per_sec": 100.0 * step, "elapsed_sec": 0.1 * step,
                  "sim_time": 1.5 * step if sim else float(step)}
        if step == 1:
            record["includes_compilation"] = True
        if stale:
            record.update(staleness_mean=1.0, staleness_max=2.0)
        if divergence and step % 4 == 0:
            record["replica_divergence"] = 0.01 * step
        records.append(record)
    records.append({"step": 10, "eval_loss": 0.3, "eval_accuracy": 0.9})
    if stopped:
        records.append({"stopped": stopped})
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_report_writes_a_png_and_a_table_from_two_runs(tmp_path, capsys):
    sync = write_run(tmp_path / "sync.jsonl", "sync")
    ssp = write_run(tmp_path / "ssp.jsonl", "ssp", sim=True, stale=True, stopped="interrupted")
    local = write_run(tmp_path / "local.jsonl", "local_sgd", divergence=True)
    out = tmp_path / "report.png"
    assert report.main([sync, ssp, local, "-o", str(out), "--table", str(tmp_path / "table.md")]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    printed = capsys.readouterr().out
    table = (tmp_path / "table.md").read_text()
    assert table.strip() in printed
    lines = table.strip().splitlines()
    assert lines[0] == ("| run | steps | final loss | held-out loss | samples/s (median) | sim_time | ended |")
    assert lines[2] == "| sync, mesh 2x4 | 10 | 0.2 | 0.3 | 600 |  | completed |"
    assert lines[3] == "| ssp, mesh 2x4 | 10 | 0.2 | 0.3 | 600 | 15 | interrupted |"


def test_panels_follow_the_data():
    runs = [report.Run.__new__(report.Run) for _ in range(1)]
    run = runs[0]
    run.path, run.name, run.config, run.evals, run.stopped = "a.jsonl", "a", {}, [], None
    run.steps = [{"step": 1, "loss": 1.0, "sim_time": 1.0}, {"step": 2, "loss": 0.5, "sim_time": 2.0}]
    assert len(report.figure(runs).axes) == 1  # sim_time equal to the step count: no simulated-time panel
    run.steps[1]["sim_time"] = 3.0
    run.steps[1].update(staleness_mean=1.0, staleness_max=1.0, replica_divergence=0.1)
    titles = [ax.get_title() for ax in report.figure(runs).axes]
    assert titles == ["loss against step", "loss against simulated time", "staleness of applied gradients",
                      "replica divergence at meetings"]


@pytest.mark.parametrize("content, message", [
    (None, "no such file; pass the JSONL file a run wrote with --metrics"),
    ("", "has no step records"),
    ('{"mesh": "2x4"}\nnot json\n', "line 2: not JSON"),
    ("[1, 2]\n", "line 1: not a JSON object"),
])
def test_bad_input_is_one_line_and_writes_nothing(content, message, tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    if content is not None:
        path.write_text(content)
    out = tmp_path / "report.png"
    assert report.main([str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err and err.startswith("jaxpar.report: error: ")
    assert not out.exists()


def test_an_output_folder_that_does_not_exist_is_refused(tmp_path, capsys):
    run = write_run(tmp_path / "a.jsonl", "sync")
    assert report.main([run, "-o", str(tmp_path / "missing" / "r.png")]) == 2
    assert "the folder" in capsys.readouterr().err
