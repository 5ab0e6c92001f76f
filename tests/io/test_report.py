"""`python -m jaxpar.report`: a PNG and a markdown table from JSONL files; bad input is one line."""

import json
import os

import pytest

from jaxpar.io import report


RUNS = {"sync": [], "local_sgd": ["--strategy", "local_sgd", "--sync-period", "2"],
        "ssp": ["--strategy", "ssp", "--staleness", "1", "--stragglers", "1:3.0"]}  # sim_time 1, 3, 6, 9 at steps 1, 2, 4, 6


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    """JSONL files that run.py really wrote: three strategies, 6 steps, logged every 2, held-out every 3."""
    import run

    folder = tmp_path_factory.mktemp("runs")
    paths = {}
    for name, flags in RUNS.items():
        paths[name] = str(folder / f"{name}.jsonl")
        assert run.main(["--model", "mlp", "--mesh", "4x2", "--steps", "6", "--log-every", "2", "--eval-every", "3",
                         *flags, "--metrics", paths[name]]) == 0
    return paths


def records(path):
    return [json.loads(line) for line in open(path, encoding="utf-8").read().splitlines()]


def png_size(path):
    head = open(path, "rb").read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


@pytest.mark.slow
def test_report_of_runs_that_run_py_wrote(jsonl, tmp_path, capsys):
    capsys.readouterr()
    out, table_file = tmp_path / "report.png", tmp_path / "table.md"
    assert report.main([jsonl["sync"], jsonl["local_sgd"], jsonl["ssp"], "-o", str(out), "--table",
                        str(table_file)]) == 0
    printed = capsys.readouterr().out
    # four panels (loss / step, loss / simulated time for the --stragglers run, staleness for ssp, divergence for
    # local SGD), each 3.6 x 9 inches at 110 dpi
    assert png_size(out) == (990, 4 * 396)
    table = table_file.read_text()
    assert table.strip() in printed and printed.rstrip().endswith(f"wrote {out}\nwrote {table_file}")
    lines = table.strip().splitlines()
    assert lines[0] == "| run | steps | final loss | held-out loss | samples/s (median) | sim_time | ended |"
    assert len(lines) == 2 + len(RUNS)
    for line, name in zip(lines[2:], RUNS):
        rows = records(jsonl[name])
        config, steps = rows[0], [r for r in rows if "loss" in r]
        evals = [r for r in rows if "eval_loss" in r]
        assert config["strategy"] == name and [r["step"] for r in steps] == [1, 2, 4, 6]
        timed = [r["samples_per_sec"] for r in steps[1:] if not r.get("includes_compilation")]
        # the median over the records not marked as compiling (local SGD compiles its meeting at step 2)
        assert 2 <= len(timed) <= 3
        median = sorted(timed)[1] if len(timed) == 3 else (timed[0] + timed[1]) / 2
        sim = f"{steps[-1]['sim_time']:.4g}" if name == "ssp" else ""  # only the --stragglers run is simulated
        assert line.split(" | ") == [f"| {name}, mesh 4x2", "6", f"{steps[-1]['loss']:.4g}",
                                     f"{evals[-1]['eval_loss']:.4g}", f"{median:.4g}", sim, "completed |"], line


@pytest.mark.slow
def test_the_figure_draws_the_records_of_the_jsonl(jsonl):
    runs = [report.Run(jsonl[name]) for name in RUNS]
    axes = report.figure(runs).axes
    assert [ax.get_title() for ax in axes] == ["loss against step", "loss against simulated time",
                                              "staleness of applied gradients", "replica divergence at meetings"]
    for name in RUNS:
        rows = records(jsonl[name])
        steps = [r for r in rows if "loss" in r]
        evals = [r for r in rows if "eval_loss" in r]
        by_label = {line.get_label(): line for line in axes[0].lines}
        label = f"{name}, mesh 4x2"
        assert list(by_label[label].get_xdata()) == [r["step"] for r in steps]
        assert list(by_label[label].get_ydata()) == [r["loss"] for r in steps]
        assert list(by_label[f"{label}: held-out"].get_ydata()) == [r["eval_loss"] for r in evals]
    ssp = [r for r in records(jsonl["ssp"]) if "loss" in r]
    (simulated,) = axes[1].lines  # the sync and local SGD runs have no straggler profile: sim_time is the step
    assert list(simulated.get_xdata()) == [r["sim_time"] for r in ssp] == [1.0, 3.0, 6.0, 9.0]
    assert list(simulated.get_ydata()) == [r["loss"] for r in ssp]
    assert [list(line.get_ydata()) for line in axes[2].lines] == [[r["staleness_mean"] for r in ssp],
                                                                   [r["staleness_max"] for r in ssp]]
    local = [r for r in records(jsonl["local_sgd"]) if "replica_divergence" in r]
    (divergence,) = axes[3].lines
    assert len(local) == 3 and list(divergence.get_ydata()) == [r["replica_divergence"] for r in local]
    assert len(report.figure(runs[:1]).axes) == 1  # sync alone: the loss panel only


@pytest.mark.slow
def test_output_naming_a_folder_writes_report_png_in_it(jsonl, tmp_path, capsys):
    folder = tmp_path / "m"
    folder.mkdir()
    capsys.readouterr()
    assert report.main([jsonl["sync"], "-o", str(folder)]) == 0
    assert os.listdir(folder) == ["report.png"] and not (tmp_path / "m.png").exists()
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {folder / 'report.png'}"
    png_size(folder / "report.png")


@pytest.mark.slow
def test_output_without_an_extension_says_the_file_really_written(jsonl, tmp_path, capsys):
    capsys.readouterr()
    assert report.main([jsonl["sync"], "-o", str(tmp_path / "n")]) == 0
    assert os.listdir(tmp_path) == ["n.png"]
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {tmp_path / 'n.png'}"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["missing folder", "a folder", "under a file"])
def test_an_unwritable_table_is_blamed_on_table_and_nothing_is_written(where, jsonl, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    table = {"missing folder": tmp_path / "missing" / "t.md", "a folder": tmp_path,
             "under a file": tmp_path / "file" / "t.md"}[where]
    out = tmp_path / "report.png"
    capsys.readouterr()
    assert report.main([jsonl["sync"], "-o", str(out), "--table", str(table)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"jaxpar.report: error: --table {str(table)!r}: "), err
    assert sorted(os.listdir(tmp_path)) == ["file"]  # no PNG either


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


@pytest.mark.slow
def test_an_output_folder_that_does_not_exist_is_refused(jsonl, tmp_path, capsys):
    capsys.readouterr()
    assert report.main([jsonl["sync"], "-o", str(tmp_path / "missing" / "r.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar.report: error: -o ") and "the folder" in err and os.listdir(tmp_path) == []
