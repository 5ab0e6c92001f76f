"""Plots and a table of finished runs, from their `--metrics` JSONL files (matplotlib).

    python -m jaxpar.report sync.jsonl local.jsonl -o report.png      # one figure, all runs on each panel

Panels, each drawn only when some run has its data: training loss (and held-out loss, as markers) against step;
training loss against simulated time (runs with `--stragglers`, where time is not just the step count); training
loss against wall-clock time (`--runtime ray` runs, whose records carry `wall_time`); staleness
(SSP / ASP: mean and max of the applied gradients); replica divergence (local SGD / DiLoCo, at each meeting).
A table of each run's final numbers is printed as markdown (`--table FILE.md` writes it too).

A run is labelled by its file name, strategy and mesh. A file that is missing, empty or has no step records is
refused in one line (exit code 2); so is an output that cannot be written (`-o`, `--table`): both are checked
before either is written, so nothing is written then. `-o FOLDER` writes FOLDER/report.png; the last line names
the files really written.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import sys

from jaxpar.io.metrics import EVAL_PREFIX
from jaxpar.checks import unwritable_file
from jaxpar.errors import DataError


class Run:
    """One JSONL file: its config record, step records, held-out records and how it ended."""

    def __init__(self, path: str):
        self.path, self.name = path, os.path.splitext(os.path.basename(path))[0]
        try:
            with open(path, encoding="utf-8") as handle:
                lines = handle.read().splitlines()
        except FileNotFoundError:
            raise DataError(f"{path!r}: no such file; pass the JSONL file a run wrote with --metrics") from None
        except (OSError, UnicodeDecodeError) as error:
            raise DataError(f"{path!r}: cannot be read ({error}); pass a --metrics JSONL file") from None
        self.config, self.steps, self.evals, self.stopped = {}, [], [], None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise DataError(f"{path!r} line {number}: not JSON; pass a --metrics JSONL file") from None
            if not isinstance(record, dict):
                raise DataError(f"{path!r} line {number}: not a JSON object; pass a --metrics JSONL file")
            if "stopped" in record:
                self.stopped = record["stopped"]
            elif "step" in record and "loss" in record:
                self.steps.append(record)
            elif "step" in record and any(k.startswith(EVAL_PREFIX) for k in record):
                self.evals.append(record)
            elif "step" not in record and not self.config:
                self.config = record
        if not self.steps:
            raise DataError(f"{path!r}: has no step records (a step record has 'step' and 'loss'); pass the JSONL "
                            f"file a run wrote with --metrics")

    @property
    def label(self) -> str:
        parts = [self.name]
        if self.config.get("strategy") and str(self.config["strategy"]) not in self.name:
            parts.append(str(self.config["strategy"]))
        if self.config.get("mesh"):
            parts.append(f"mesh {self.config['mesh']}")
        return ", ".join(parts)

    def series(self, key: str, x: str = "step") -> tuple[list, list]:
        points = [(r[x], r[key]) for r in self.steps if isinstance(r.get(key), (int, float))
                  and isinstance(r.get(x), (int, float))]
        return [p[0] for p in points], [p[1] for p in points]

    def has(self, key: str) -> bool:
        return any(isinstance(r.get(key), (int, float)) for r in self.steps)

    def simulated(self) -> bool:
        """True when the run's sim_time means something: it ran with --stragglers, or its sim_time differs from the
        step count (without a straggler profile sim_time is just the step count)."""
        if not self.has("sim_time"):
            return False
        return bool(self.config.get("stragglers")) or any(
            isinstance(r.get("sim_time"), (int, float)) and abs(r["sim_time"] - r["step"]) > 1e-9 for r in self.steps)

    def summary(self) -> dict:
        last = self.steps[-1]
        timed = [r["samples_per_sec"] for r in self.steps[1:] if isinstance(r.get("samples_per_sec"), (int, float))
                 and not r.get("includes_compilation")]
        held = self.evals[-1] if self.evals else {}
        return {"run": self.label, "steps": last["step"], "final loss": last.get("loss"),
                "held-out loss": held.get("eval_loss"),
                "samples/s (median)": statistics.median(timed) if timed else None,
                "sim_time": last.get("sim_time") if self.simulated() else None,
                "skipped steps": last.get("skipped_steps"), "ended": self.stopped or "completed"}


def table(runs: list[Run]) -> str:
    """Markdown table of the runs' final numbers."""
    rows = [run.summary() for run in runs]
    columns = [c for c in rows[0] if any(row[c] is not None for row in rows)]

    def cell(value):
        if value is None:
            return ""
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def figure(runs: list[Run]):
    """The matplotlib figure of the runs (see the module docstring for its panels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("loss", "training loss (nats)", "step", "loss against step")]
    if any(run.simulated() for run in runs):
        panels.append(("loss", "training loss (nats)", "sim_time", "loss against simulated time"))
    if any(run.has("wall_time") for run in runs):  # runs on the ray runtime: real time
        panels.append(("loss", "training loss (nats)", "wall_time", "loss against wall-clock time"))
    if any(run.has("staleness_mean") for run in runs):
        panels.append(("staleness", "staleness (updates behind)", "step", "staleness of applied gradients"))
    if any(run.has("replica_divergence") for run in runs):
        panels.append(("replica_divergence", "replica divergence (relative distance)", "step", "replica divergence at meetings"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.6 * len(panels)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, ylabel, x, title) in zip(axes[:, 0], panels):
        for index, run in enumerate(runs):
            color = colors[index % len(colors)]
            if key == "staleness":
                xs, ys = run.series("staleness_mean")
                if xs:
                    ax.plot(xs, ys, color=color, label=f"{run.label}: mean")
                    ax.plot(*run.series("staleness_max"), color=color, linestyle=":", label=f"{run.label}: max")
                continue
            if (x == "sim_time" and not run.simulated()) or (x == "wall_time" and not run.has("wall_time")):
                continue
            xs, ys = run.series(key, x)
            if not xs:
                continue
            style = {"marker": "o", "markersize": 3} if key == "replica_divergence" else {}
            ax.plot(xs, ys, color=color, label=run.label, **style)
            if key == "loss" and x == "step" and run.evals:
                ex = [r["step"] for r in run.evals if isinstance(r.get("eval_loss"), (int, float))]
                ey = [r["eval_loss"] for r in run.evals if isinstance(r.get("eval_loss"), (int, float))]
                ax.plot(ex, ey, color=color, marker="s", linestyle="none", markersize=6,
                        label=f"{run.label}: held-out")
        ax.set_title(title)
        ax.set_xlabel({"sim_time": "simulated time (one unit = one step's compute on a replica of speed 1)",
                       "wall_time": "wall-clock seconds since the first update"}.get(x, "step (optimizer updates)"))
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2, no usage dump
        print(f"jaxpar.report: error: {message} (see python -m jaxpar.report --help)", file=sys.stderr)
        sys.exit(2)


DEFAULT_NAME = "report.png"


def figure_path(output: str) -> str:
    """The file `-o` names: an existing folder (or a path ending in a separator) gets `report.png` inside it; a path
    without an extension gets `.png`, as matplotlib would add it, so the message names the file really written."""
    if output.endswith(("/", os.sep)) or os.path.isdir(output):
        return os.path.join(output, DEFAULT_NAME)
    if not os.path.splitext(output)[1]:
        return output + ".png"
    return output


def main(argv=None) -> int:
    parser = _Parser(prog="python -m jaxpar.report", description="Plot runs' --metrics JSONL files and print a "
                                                                 "table of their final numbers.")
    parser.add_argument("runs", nargs="+", help="JSONL files written by run.py --metrics")
    parser.add_argument("-o", "--output", default=DEFAULT_NAME,
                        help=f"the figure (PNG, PDF or SVG; default {DEFAULT_NAME}; a folder gets {DEFAULT_NAME} in it)")
    parser.add_argument("--table", default=None, help="also write the markdown table to this file")
    args = parser.parse_args(argv)

    def error(message: str) -> int:
        print(f"jaxpar.report: error: {message}", file=sys.stderr)
        return 2

    try:
        runs = [Run(path) for path in args.runs]
    except DataError as problem:
        return error(str(problem))
    output = figure_path(args.output)
    kind = os.path.splitext(output)[1][1:].lower()
    fig = figure(runs)
    if kind not in fig.canvas.get_supported_filetypes():
        return error(f"-o {args.output!r}: cannot write a .{kind} figure; pass a path ending in .png, .pdf or .svg")
    # Both outputs are checked before either is written: a refused run leaves no file behind.
    problems = [unwritable_file(output, "-o", "pass another path ending in .png, .pdf or .svg")]
    if args.table:
        problems.append(unwritable_file(args.table, "--table", "pass another path for the markdown table"))
    for problem in problems:
        if problem:
            return error(problem)
    text = table(runs)
    rendered = io.BytesIO()
    fig.savefig(rendered, format=kind, dpi=110)
    for path, flag, content in ((output, "-o", rendered.getvalue()),
                                (args.table, "--table", (text + "\n").encode("utf-8"))):
        if not path:
            continue
        try:
            with open(path, "wb") as handle:
                handle.write(content)
        except OSError as problem:
            return error(f"{flag} {path!r}: cannot be written ({problem.strerror or problem}); pass another path")
    print(text)
    for path in (output, args.table):
        if path:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
