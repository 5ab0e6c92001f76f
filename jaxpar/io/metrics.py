"""Console progress and a JSONL metrics file: one JSON object per logged step, ready for pandas or plotting.

The first record is the run's resolved configuration (with library versions). Every step record has `step`,
`loss`, `samples_per_sec` (examples whose gradient was applied, over the steps since the previous record: under
SSP / ASP only the contributing replicas' examples count; the first record covers only the first step, which
includes compilation), `elapsed_sec`, and whatever the loss function and the strategy returned.

The file is written safely: records go to a temporary file in the target's folder (fsync'd as it is opened, so a
path that cannot really be written fails before training), and `close()` renames it over the target. A run that
fails before it starts training leaves an existing file untouched (`discard()`); a run that ends early (an error,
Ctrl-C, SIGTERM) still commits what it logged, ending with a `{"stopped": ...}` record. Values are strict JSON:
a non-finite number (a NaN loss) is written as null.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from typing import IO

from jaxpar.errors import JaxparError


EVAL_PREFIX = "eval_"  # an evaluation record: "step" and eval_ + each held-out metric (eval_perplexity for LMs)


def strict_json(value):
    """`value` with every non-finite float replaced by None, so `json.dumps(..., allow_nan=False)` succeeds."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def records_before(path: str, step: int) -> list[dict]:
    """The records of an earlier run's metrics file up to `step` (its config records and its step and evaluation
    records with `step` <= `step`; no `stopped` record): what a run resumed at `step` continues from. A missing or
    unreadable file gives []."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or "stopped" in record:
            continue
        if "step" not in record or (isinstance(record["step"], int) and record["step"] <= step):
            kept.append(record)
    return kept


class JsonlFile:
    """A JSONL file written to `.<name>.*.tmp` next to `path` (after symlinks) and renamed onto it by `commit()`.

    Opening it creates the temporary file and writes, flushes and fsyncs one byte (then truncates it): a folder
    that refuses files (/proc, /sys, read-only mounts) or a full disk fails here, as a `JaxparError` naming `flag`.
    """

    def __init__(self, path: str, flag: str = "--metrics"):
        self.path, self.flag = os.path.realpath(path), flag
        folder, name = os.path.split(self.path)
        try:
            fd, self._temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        except OSError as error:
            raise JaxparError(f"{flag} {path!r}: cannot create a file in {folder!r} ({error.strerror}); pass a path "
                              f"in a writable folder, e.g. run.jsonl") from None
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        umask = os.umask(0)
        os.umask(umask)
        try:
            # the mode open() would give (mkstemp makes it private), or the replaced file's
            os.fchmod(fd, os.stat(self.path).st_mode & 0o7777 if os.path.isfile(self.path) else 0o666 & ~umask)
            self._file.write("\n")
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.seek(0)
            self._file.truncate()
        except OSError as error:
            self.discard()
            raise JaxparError(f"{flag} {path!r}: cannot write in {folder!r} ({error.strerror}); pass a path on a "
                              f"writable file system with free space") from None

    def write(self, record: dict) -> None:
        try:
            self._file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
            self._file.flush()
        except OSError as error:
            raise JaxparError(f"{self.flag} {self.path!r}: writing failed ({error.strerror}); free space or pass "
                              f"another path") from None

    def commit(self) -> None:
        """Closes the file and renames it onto the target path."""
        if self._file is None:
            return
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            os.replace(self._temp, self.path)
            self._temp = None
        except OSError as error:
            self.discard()
            raise JaxparError(f"{self.flag} {self.path!r}: could not be saved ({error.strerror}); free space or "
                              f"pass another path") from None

    def discard(self) -> None:
        """Closes and removes the temporary file; the target path is left as it was."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._temp is not None:
            try:
                os.unlink(self._temp)
            except OSError:
                pass
            self._temp = None


class RunLogger:
    """Progress on the console and records in the JSONL file.

    `progress`: "lines" prints one line per logged step; "bar" keeps a live progress bar (rich) at the bottom of
    the terminal, updated every step (step, loss, samples/s or tokens/s, ETA from the steps after the first, which
    includes compilation), with the logged lines printed above it; "auto" (default) is "bar" when the output is a
    terminal and "lines" otherwise (CI, pipes, files). `tokens_per_example`: records `tokens_per_sec` too (an LM's
    sequence length)."""

    def __init__(self, total_steps: int, global_batch, log_every: int, jsonl_path: "str | JsonlFile | None" = None,
                 stream: IO[str] | None = None, quiet=(), start_step: int = 0, progress: str = "auto",
                 tokens_per_example: int | None = None, tensorboard=None,
                 peak_flops: float | None = None):
        self.total_steps, self.log_every = total_steps, log_every
        self.tokens_per_example, self._tensorboard = tokens_per_example, tensorboard
        self.peak_flops = peak_flops  # FLOP/s all devices together can do: the utilisation's denominator
        self._flops = 0.0  # FLOPs of the steps since the last record (by XLA's cost analysis of each step)
        self.start = start_step  # steps already done (a resumed run): its first step is start_step + 1
        self.quiet = set(quiet)  # metrics recorded in the JSONL but not printed
        # global batch size of step n (0-based): an int, or a function for a batch-size ramp
        self.batch_at = global_batch if callable(global_batch) else (lambda step: global_batch)
        self.stream = stream
        self._file = jsonl_path if isinstance(jsonl_path, JsonlFile) else JsonlFile(jsonl_path) if jsonl_path else None
        self._start = self._last_time = time.perf_counter()
        self._last_step = start_step
        self._examples = 0.0  # examples applied since the last record
        out = stream or sys.stdout
        if progress == "auto":
            progress = "bar" if getattr(out, "isatty", lambda: False)() else "lines"
        if progress not in ("bar", "lines"):
            raise ValueError(f"progress {progress!r}: choose auto, bar or lines")
        self._bar = _Bar(total_steps, start_step, out) if progress == "bar" else None

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        """Call after every step; prints and records every `log_every` steps (and the first and last)."""
        metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}  # array metrics: not logged
        self._examples += metrics.pop("examples", self.batch_at(step - 1))
        self._flops += metrics.pop("flops", 0.0)
        self._compiled = metrics.pop("compiled", 0.0) > 0 or getattr(self, "_compiled", False)
        if step == self.start + 1:
            self._first_done = time.perf_counter()  # the ETA leaves out the first step: it includes compilation
        if self._bar is not None:
            self._bar.update(step, metrics.get("loss"), self._eta(step, time.perf_counter()))
        if step % self.log_every and step not in (self.start + 1, self.total_steps):
            return
        now = time.perf_counter()
        rate = self._examples / max(now - self._last_time, 1e-9)
        record = {"step": step, **metrics, "samples_per_sec": rate, "elapsed_sec": now - self._start}
        if self.tokens_per_example:
            record["tokens_per_sec"] = rate * self.tokens_per_example
        if self._flops:
            record["flops_per_sec"] = self._flops / max(now - self._last_time, 1e-9)
            if self.peak_flops:
                record["flops_utilization"] = record["flops_per_sec"] / self.peak_flops
        self._flops = 0.0
        compiled, self._compiled = self._compiled, False
        if compiled:  # the window's time includes a compilation (the first step, a batch-ramp size, ...)
            record["includes_compilation"] = True
        self._last_step, self._last_time, self._examples = step, now, 0.0
        self.write(record)
        remaining = self._eta(step, now)
        shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k not in self.quiet)
        eta = "" if math.isnan(remaining) else f"  eta {remaining:.0f}s"
        first = "  (includes compilation)" if compiled else ""
        tokens = f"  {record['tokens_per_sec']:.0f} tokens/s" if self.tokens_per_example else ""
        line = f"step {step}/{self.total_steps}  {shown}  {rate:.0f} samples/s{tokens}{eta}{first}"
        if self._bar is not None:
            self._bar.line(line, rate * (self.tokens_per_example or 1), "tokens/s" if self.tokens_per_example
                           else "samples/s")
        else:
            print(line, file=self.stream or sys.stdout, flush=True)

    def _eta(self, step: int, now: float) -> float:
        """Seconds left, projected from the steps after the first (which includes compilation); nan before."""
        first_done = getattr(self, "_first_done", None)
        done = step - self.start - 1
        return (self.total_steps - step) * (now - first_done) / done if done > 0 and first_done is not None else math.nan

    def write(self, record: dict) -> None:
        """Appends one record to the JSONL file (if any) and the TensorBoard events (if any); also used for
        evaluation results."""
        if self._file:
            self._file.write(record)
        if self._tensorboard is not None:
            self._tensorboard.write(record)

    def close(self, commit: bool = True) -> None:
        """Saves the JSONL file onto its path (`commit=False`: drops it, leaving the path as it was)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._tensorboard is not None:
            board, self._tensorboard = self._tensorboard, None
            board.close()
        if self._file:
            file, self._file = self._file, None
            file.commit() if commit else file.discard()


class _Bar:
    """A rich progress bar on `out` (a terminal): step / total, the last loss, throughput and ETA."""

    def __init__(self, total: int, start: int, out):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
                                 console=Console(file=out), transient=False)
        self.task = self.progress.add_task("train", total=total, completed=start, info="")
        self.rate = ""
        self.progress.start()

    def update(self, step: int, loss, eta: float) -> None:
        info = "" if loss is None else f"loss {loss:.4g}"
        if self.rate:
            info += f"  {self.rate}"
        info += "  eta " + ("(after the first step)" if math.isnan(eta) else f"{eta:.0f}s")
        self.progress.update(self.task, completed=step, info=info)

    def line(self, text: str, rate: float, unit: str) -> None:
        self.rate = f"{rate:.0f} {unit}"
        self.progress.console.print(text, markup=False, highlight=False)

    def stop(self) -> None:
        self.progress.stop()
