"""The suite's results file: number formatting, a benchmark's JSON rows and printed output, and the markdown."""

from __future__ import annotations

import json
import os

DISTRIBUTED = ("`benchmarks.distributed` is not run by this suite: it needs PyTorch (`pip install -e '.[bench]'`) "
               "and 2 processes. Run it separately: `python -m benchmarks.distributed ddp` and "
               "`python -m benchmarks.distributed processes`.")


def num(value, digits: int = 4) -> str:
    """A number in a summary cell: integers with separators, floats to `digits` significant digits, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if abs(value) >= 10 ** digits:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def json_rows(stdout: str) -> list[dict]:
    rows = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                rows.append(value)
        # anything else is the human-readable output
    return rows


def is_json_line(line: str) -> bool:
    line = line.strip()
    if not line.startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def output_blocks(stdout: str) -> list[str]:
    """The human-readable output (JSON lines left out): markdown tables as tables, the rest in text blocks."""
    lines = [line.rstrip() for line in stdout.splitlines() if not is_json_line(line)]
    out, text, i = [], [], 0

    def flush():
        while text and not text[-1].strip():
            text.pop()
        while text and not text[0].strip():
            text.pop(0)
        if text:
            out.extend(["```text", *text, "```", ""])
        text.clear()

    while i < len(lines):
        j = i
        while j < len(lines) and lines[j].lstrip().startswith("|"):
            j += 1
        if j - i >= 2 and set(lines[i + 1].replace("|", "").strip()) <= set("-: "):  # a markdown table
            flush()
            out.extend([*lines[i:j], ""])
            i = j
        else:
            text.append(lines[i])
            i += 1
    flush()
    return out


def render(results: list, info: dict, done: bool) -> str:
    """The results file's markdown for the runner's `Result`s so far (`done`: all have run) and the run's `info`."""
    out = ["# jaxpar benchmark results", ""]
    mode = "quick (`--quick`: small settings)" if info["quick"] else "full (each script's defaults)"
    out += [f"- **date**: {info['date']}", f"- **command**: `{info['command']}` (mode: {mode})",
            f"- **git commit**: {info['commit']}"]
    out += [f"- **{k}**: {v}" for k, v in info["machine"]]
    out += [f"- **load average** at the start: {info['load_start']}" +
            (f"; at the end: {info['load_end']}" if done else ""), ""]
    finished = [r for r in results if r.returncode is not None or r.not_run]
    if not done:
        out += [f"**Incomplete**: {len(finished)} of {len(results)} benchmarks done so far.", ""]
    else:
        failed = [r.bench.name for r in results if r.error]
        total = sum(r.seconds for r in results)
        out += [f"{len(results)} benchmarks in {total:.0f} s; " +
                (f"**failed: {', '.join(failed)}**." if failed else "all succeeded."), ""]
    out += ["Wall times are from 8 CPU devices emulated on this machine's cores; other processes may have shared "
            "them (see the load average). Each script's docstring says what it measures and how to read it.", ""]

    out += ["## Summary", "", "| benchmark | command | key numbers | wall s |", "|---|---|---|---|"]
    for r in results:
        if r.returncode is None and not r.not_run:
            numbers, seconds = "(not run yet)", "-"
        elif r.error:
            numbers = f"**FAILED**: {r.error}"
            if r.summary:
                numbers += "<br>" + "<br>".join(r.summary)
            seconds = f"{r.seconds:.1f}" if not r.not_run else "-"
        else:
            numbers, seconds = "<br>".join(r.summary), f"{r.seconds:.1f}"
        out.append(f"| {r.bench.name} | `{cell(r.command)}` | {cell(numbers)} | {seconds} |")
    out.append(f"| distributed | `python -m benchmarks.distributed ddp` | not run here: needs torch and 2 processes; "
               f"run it separately | - |")
    out += ["", DISTRIBUTED, ""]

    for r in results:
        if r.returncode is None and not r.not_run:
            continue
        plural = "s" * (len(r.rows) != 1)
        status = f"**FAILED**: {r.error}" if r.error else f"{r.seconds:.1f} s, {len(r.rows)} JSON row{plural}"
        out += [f"## {r.bench.name}", "", f"{r.bench.what}. `{r.command}`: {status}.", ""]
        out += output_blocks(r.stdout)
        if r.error and r.stderr.strip():
            tail = r.stderr.strip().splitlines()[-30:]
            out += ["stderr (last 30 lines):", "", "```text", *tail, "```", ""]
        if r.rows:
            out += ["<details><summary>JSON rows</summary>", "", "```json", *(json.dumps(row) for row in r.rows),
                    "```", "", "</details>", ""]
    return "\n".join(out).rstrip() + "\n"


def write(path: str, text: str) -> None:
    """Replaces the file at `path` by `text` in one step (an interrupted write leaves the previous one)."""
    partial = path + ".partial"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(partial, path)
