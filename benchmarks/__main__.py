"""Run every benchmark and write one markdown results file that says which machine it ran on.

    python -m benchmarks                                   # full: each script's defaults (estimated 15-25 min)
    python -m benchmarks --quick                           # small settings, under 10 minutes on 2 cores
    python -m benchmarks --quick --only memory,overhead --out /tmp/r.md
    python -m benchmarks --dry-run                         # print the commands, run nothing

Each benchmark runs as its own subprocess (`<this python> benchmarks/X.py ...`, working directory the repository
root), so each gets its own 8 emulated CPU devices; its stdout is captured and its JSON lines (one object per line,
as every script prints them) are parsed for the summary. A benchmark has a timeout, and the whole run a budget
(--budget, default 570 s with --quick, 2400 s without): a benchmark never gets more than what is left of it. One
that fails, times out or prints no JSON line gets a row saying so (exit code and last stderr line) and the run goes
on; the exit code is 1 if any failed. The results file is rewritten after every benchmark, so an interrupted run
leaves what it measured.

The file: a header (date, machine: CPU model, cores, memory, load average; Python, jax, jaxlib, flax, optax and numpy
versions; git commit; the exact command), a summary table (benchmark, command, key numbers, wall seconds), then
each benchmark's own printed output (its markdown tables as tables, the rest in a text block) and its JSON rows.
`benchmarks/distributed.py` is not run (it needs torch and 2 processes): run it separately.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join("benchmarks", "RESULTS.md")
BUDGET = {True: 570, False: 2400}  # seconds for the whole run: --quick, full
DISTRIBUTED = ("`benchmarks/distributed.py` is not run by this suite: it needs PyTorch (`pip install -e '.[bench]'`) "
               "and 2 processes. Run it separately: `python benchmarks/distributed.py ddp` and "
               "`python benchmarks/distributed.py processes`.")


# --- formatting helpers ---------------------------------------------------------------------------------------------
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


# --- key numbers per benchmark (each gets the JSON rows of its script, returns the lines of its summary cell) -------
def overhead_summary(rows):
    r = rows[-1]
    return [f"jaxpar / hand-written jit **{r['ratio']:.3f}** ({r['jaxpar_steps_per_sec']:.2f} vs "
            f"{r['hand_jit_steps_per_sec']:.2f} steps/s; {r.get('model')} on `{r.get('mesh')}`)"]


def collectives_summary(rows):
    first = rows[0]
    lines = [f"{first.get('model')} on `{first.get('mesh')}`, gradient {num(first.get('gradient_bytes'))} B; "
             f"bytes sent per device vs theory, steps/s vs psum:"]
    for r in rows:
        theory, sent = r["theory_bytes_sent_per_device"], r["permute_bytes_sent_max_device"]
        if sent:
            bytes_part = f"sent {num(sent)} / theory {num(theory)} = **{sent / theory:.3f}**"
        else:  # the partitioner's / psum's all-reduce: result bytes only (how XLA:CPU moves them is not in HLO)
            bytes_part = f"all-reduce of {num(r['all-reduce_bytes'])} B (theory sends {num(theory)})"
        lines.append(f"{r['variant']}: {bytes_part}; **{r['ratio_to_psum']:.2f}x** psum "
                     f"({r['steps_per_sec']:.2f} steps/s)")
    return lines


def fsdp_summary(rows):
    lines = ["FSDP traffic measured / theory 3(N-1)/N P_f: all (params + grads only):"]
    for r in rows:
        theory = r.get("fsdp_theory_sent_per_device")
        if theory:
            lines.append(f"`{r['mesh']}`: **{r['fsdp_sent_per_device'] / theory:.2f}** "
                         f"({r['fsdp_sent_params_grads_per_device'] / theory:.2f}); {r['steps_per_sec']:.2f} steps/s")
        else:
            lines.append(f"`{r['mesh']}`: no fsdp axis; {r['steps_per_sec']:.2f} steps/s")
    return lines


def comm_summary(rows):
    """Per mesh and strategy: bytes the busiest device sends over data per step (variants weighted by their share)
    against theory, and any collective theory does not explain."""
    lines = [f"{rows[0].get('model')}: data-axis bytes sent per step by the busiest device / theory:"]
    for r in rows:
        theory = r.get("data_theory_per_step")
        ratio = f"**{r['data_sent_per_step'] / theory:.3f}**" if theory else "no exchange"
        unexpected = sum(v.get("unexpected", 0) for v in r.get("variants", {}).values())
        lines.append(f"`{r['mesh']}` {r['strategy']}: {ratio}" + (f", {unexpected} unexpected" if unexpected else ""))
    return lines


def memory_summary(rows):
    lines = ["train state per device / total (sharded part per device / its total):"]
    for model in dict.fromkeys(r["model"] for r in rows):
        cells = []
        for r in (r for r in rows if r["model"] == model):
            if "skipped" in r:
                cells.append(f"`{r['mesh']}` skipped")
            else:
                sharded = f" ({r['sharded_ratio']:.4f})" if r.get("sharded_ratio") else ""
                cells.append(f"`{r['mesh']}` **{r['ratio']:.4f}**{sharded}")
        lines.append(f"{model}: " + ", ".join(cells))
    return lines


LABEL_KEYS = ("task", "scenario", "profile", "hardware", "strategy")


def strategies_summary(rows):
    """Every row's label and its `*_to_target` keys, whatever they are (the script's keys may change)."""
    lines = []
    for r in rows:
        targets = {k: v for k, v in r.items() if k.endswith("_to_target")}
        if not targets:
            continue
        label = " / ".join(str(r[k]) for k in LABEL_KEYS if isinstance(r.get(k), (str, int, float)))
        if not label:
            label = " / ".join(str(v) for v in r.values() if isinstance(v, str))
        shown = ", ".join(f"{k.removesuffix('_to_target')} {'never' if v is None else num(v)}"
                          for k, v in targets.items())
        lines.append(f"{label}: {shown}")
    if not lines:
        return [f"{len(rows)} JSON rows, none with a `*_to_target` key"]
    targets = {str(r.get("task", "all")): r["target_loss"] for r in rows if "target_loss" in r}
    if targets:
        lines.insert(0, "target loss: " + ", ".join(f"{t} {num(v)}" for t, v in targets.items()))
    return lines


def largebatch_summary(rows):
    seeds = sorted({r["seed"] for r in rows})
    lines = [f"test accuracy, mean of seeds {','.join(map(str, seeds))} (* = a seed diverged):"]
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    for batch in dict.fromkeys(r["batch_size"] for r in rows):
        cells = []
        for recipe in recipes:
            chosen = [r for r in rows if r["batch_size"] == batch and r["recipe"] == recipe]
            if chosen:
                mean = statistics.mean(r["test_accuracy"] for r in chosen)
                cells.append(f"{recipe} {mean:.4f}" + "*" * sum(bool(r.get("diverged")) for r in chosen))
        steps = next(r.get("steps") for r in rows if r["batch_size"] == batch)
        lines.append(f"batch {batch} ({steps} steps): " + ", ".join(cells))
    return lines


def checkpoint_summary(rows):
    r = rows[-1]
    return [f"with / without checkpoints **{r['ratio']:.3f}** ({r['samples_per_sec_with']:.1f} vs "
            f"{r['samples_per_sec_without']:.1f} samples/s, every {r['every']} steps on `{r['mesh']}`)"]


# --- the benchmarks -------------------------------------------------------------------------------------------------
@dataclass
class Benchmark:
    name: str
    script: str
    full: list[str] | None  # arguments in full mode (None: not run)
    quick: list[str] | None  # arguments with --quick (None: not run)
    timeout: dict  # {True: seconds with --quick, False: full}
    summarize: Callable[[list[dict]], list[str]]
    what: str


BENCHMARKS = [
    Benchmark("memory", "memory.py", [], [], {True: 240, False: 600}, memory_summary,
              "train state and compiled step bytes per device against the mesh (no training)"),
    Benchmark("overhead", "overhead.py", [], ["--rounds", "3", "--steps", "10"], {True: 240, False: 900},
              overhead_summary, "jaxpar's step vs a hand-written jax.jit step"),
    Benchmark("collectives", "collectives.py", [], ["--model", "mlp", "--steps", "10", "--rounds", "2"],
              {True: 240, False: 900}, collectives_summary, "allreduce algorithms: collectives vs theory, steps/s"),
    Benchmark("fsdp", "collectives.py", ["--fsdp"], ["--fsdp", "--steps", "5", "--rounds", "1"],
              {True: 300, False: 1200}, fsdp_summary, "FSDP (ZeRO-3) traffic on 5 meshes vs theory"),
    Benchmark("comm", "comm.py", ["--model", "transformer"], [], {True: 300, False: 1200}, comm_summary,
              "collective bytes against theory for every strategy and mesh (compiled steps, no training)"),
    Benchmark("strategies", "strategies.py", [], ["--task", "mlp", "--max-steps", "160"], {True: 300, False: 1500},
              strategies_summary, "update strategies with a straggler: steps and simulated time to a target loss"),
    Benchmark("largebatch", "largebatch.py", [], ["--epochs", "5", "--seeds", "0", "--batches", "32,256,1024"],
              {True: 300, False: 1500}, largebatch_summary, "large-batch recipes on digits: test accuracy"),
    Benchmark("checkpoint", "checkpoint.py", [], None, {True: 0, False: 900}, checkpoint_summary,
              "cost of checkpointing every 10 steps (full mode only)"),
]


@dataclass
class Result:
    bench: Benchmark
    argv: list[str]
    seconds: float = 0.0
    returncode: int | None = None
    timed_out: bool = False
    not_run: str | None = None
    stdout: str = ""
    stderr: str = ""
    rows: list[dict] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        return shlex.join(["python", f"benchmarks/{self.bench.script}", *self.argv])

    @property
    def error(self) -> str | None:
        """Why this benchmark failed, or None."""
        if self.not_run:
            return self.not_run
        last = next((line.strip() for line in reversed(self.stderr.splitlines()) if line.strip()), "")
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s" + (f"; last stderr line: {last}" if last else "")
        if self.returncode != 0:
            return f"exit code {self.returncode}" + (f"; last stderr line: {last}" if last else "")
        if not self.rows:
            return "exit code 0 but no JSON result line on stdout"
        return None


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


def run(result: Result, timeout: float) -> None:
    """Runs one benchmark as a subprocess of this Python, cwd the repository root, within `timeout` seconds."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # a killed run still leaves what it printed
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.join("benchmarks", result.bench.script), *result.argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        result.stdout, result.stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        result.timed_out = True
        proc.kill()
        result.stdout, result.stderr = proc.communicate()
    except BaseException:  # Ctrl-C: do not leave the benchmark running
        proc.kill()
        proc.communicate()
        raise
    result.seconds = time.perf_counter() - start
    result.returncode = proc.returncode
    result.rows = json_rows(result.stdout)
    if result.rows:
        try:
            result.summary = result.bench.summarize(result.rows)
        except Exception as error:  # the script's keys changed: say so in the cell, keep the rows in the file
            result.summary = [f"could not summarise its JSON rows: {type(error).__name__}: {error}"]


# --- the machine ------------------------------------------------------------------------------------------------------
def read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def machine() -> list[tuple[str, str]]:
    from importlib import metadata

    cpu = next((line.split(":", 1)[1].strip() for line in read("/proc/cpuinfo").splitlines()
                if line.lower().startswith(("model name", "hardware", "processor\t: ")) and ":" in line
                and not line.split(":", 1)[1].strip().isdigit()), "") or platform.processor() or "unknown"
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    mem = next((line.split()[1] for line in read("/proc/meminfo").splitlines() if line.startswith("MemTotal:")), None)
    memory = f"{int(mem) / 2**20:.1f} GiB" if mem else "unknown"
    versions = []
    for package in ("jax", "jaxlib", "flax", "optax", "numpy"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} (not installed)")
    return [("CPU", cpu), ("cores", f"{os.cpu_count()} ({usable} usable by this process)"), ("memory", memory),
            ("OS", platform.platform()), ("Python", f"{platform.python_version()} ({sys.executable})"),
            ("packages", ", ".join(versions)),
            ("devices", "8 emulated CPU devices per benchmark process (each benchmark is its own process)")]


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "jaxpar", "models", "benchmarks", "run.py"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" with uncommitted changes in jaxpar/, models/, benchmarks/ or run.py" if dirty
                                  else "")


def load() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)"
    except OSError:
        return "unknown"


# --- the results file -------------------------------------------------------------------------------------------------
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


def render(results: list[Result], info: dict, done: bool) -> str:
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
    out.append(f"| distributed | `python benchmarks/distributed.py ddp` | not run here: needs torch and 2 processes; "
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
    partial = path + ".partial"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(partial, path)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small settings: under 10 minutes on 2 cores")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"the markdown results file (default {DEFAULT_OUT})")
    parser.add_argument("--only", default=None,
                        help="comma-separated subset of: " + ", ".join(b.name for b in BENCHMARKS))
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run (default 570 with --quick, 2400 without); no benchmark "
                             "gets more than what is left")
    parser.add_argument("--dry-run", action="store_true", help="print the commands that would run, run nothing")
    args = parser.parse_args()

    chosen = [b for b in BENCHMARKS if (b.quick if args.quick else b.full) is not None]
    if args.only is not None:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        known = {b.name for b in BENCHMARKS}
        for name in names:
            if name not in known:
                parser.error(f"--only: {name!r} is not one of {', '.join(b.name for b in BENCHMARKS)}")
        skipped = [n for n in names if n not in {b.name for b in chosen}]
        if skipped:
            parser.error(f"--only: {', '.join(skipped)} does not run with{'' if args.quick else 'out'} --quick")
        chosen = [b for b in chosen if b.name in names]
    budget = args.budget if args.budget is not None else BUDGET[args.quick]
    if not budget > 0:
        parser.error(f"--budget {args.budget}: must be > 0")
    out_path = os.path.abspath(args.out)
    if not os.path.isdir(os.path.dirname(out_path)):
        parser.error(f"--out {args.out!r}: its folder does not exist")

    results = [Result(b, list(b.quick if args.quick else b.full)) for b in chosen]
    if args.dry_run:
        for r in results:
            print(f"{r.bench.name:12s} timeout {r.bench.timeout[args.quick]:5d} s  {r.command}")
        print(f"budget {budget:.0f} s; results would go to {args.out}")
        return 0

    info = {"quick": args.quick, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shlex.join(["python", "-m", "benchmarks", *sys.argv[1:]]), "commit": git_commit(),
            "machine": machine(), "load_start": load(), "load_end": None}
    write(out_path, render(results, info, done=False))
    started = time.perf_counter()
    try:
        for r in results:
            left = budget - (time.perf_counter() - started)
            if left < 10:
                r.not_run = f"not run: the run's budget of {budget:.0f} s was used up"
                print(f"[skip] {r.bench.name}: {r.not_run}", flush=True)
                continue
            timeout = min(r.bench.timeout[args.quick], left)
            print(f"[start] {r.bench.name}: {r.command} (timeout {timeout:.0f} s)", flush=True)
            run(r, timeout)
            status = f"FAILED ({r.error})" if r.error else "ok"
            if not r.error and r.summary and r.summary[0].startswith("could not summarise"):
                status += f", but {r.summary[0]}"
            print(f"[end]   {r.bench.name}: {r.seconds:.1f} s, {status}", flush=True)
            write(out_path, render(results, info, done=False))
    except KeyboardInterrupt:
        print("interrupted: the results file has what finished", file=sys.stderr)
        return 130
    info["load_end"] = load()
    write(out_path, render(results, info, done=True))
    failed = [r.bench.name for r in results if r.error]
    total = time.perf_counter() - started
    print(f"{len(results)} benchmarks in {total:.1f} s" + (f"; FAILED: {', '.join(failed)}" if failed else "; all ok")
          + f"; results in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
