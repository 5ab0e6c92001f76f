"""Run every benchmark and write one markdown results file that says which machine it ran on.

    python -m benchmarks                                   # full: each script's defaults (estimated 15-25 min)
    python -m benchmarks --quick                           # small settings, under 10 minutes on 2 cores
    python -m benchmarks --quick --only memory,overhead --out /tmp/r.md
    python -m benchmarks --dry-run                         # print the commands, run nothing

Each benchmark runs as its own subprocess (`<this python> -m benchmarks.X ...`, working directory the repository
root), so each gets its own 8 emulated CPU devices; its stdout is captured and its JSON lines (one object per line,
as every script prints them) are parsed, and the module's own `summarize(rows)` gives its summary cell. A
benchmark has a timeout, and the whole run a budget (--budget, default 570 s with --quick, 2400 s without): a
benchmark never gets more than what is left of it. One that fails, times out or prints no JSON line gets a row
saying so (exit code and last stderr line) and the run goes on; the exit code is 1 if any failed. The results file
is rewritten after every benchmark, so an interrupted run leaves what it measured.

The file: a header (date, machine: CPU model, cores, memory, load average; Python, jax, jaxlib, flax, optax and numpy
versions; git commit; the exact command), a summary table (benchmark, command, key numbers, wall seconds), then
each benchmark's own printed output (its markdown tables as tables, the rest in a text block) and its JSON rows.
`benchmarks.distributed` is not run (it needs torch and 2 processes): run it separately. The results file is
written by `benchmarks/report.py`, the machine described by `benchmarks/machine.py`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

from benchmarks.machine import ROOT, git_commit, load, machine
from benchmarks.report import json_rows, render, write

DEFAULT_OUT = os.path.join("benchmarks", "RESULTS.md")
BUDGET = {True: 570, False: 2400}  # seconds for the whole run: --quick, full


# --- the benchmarks -------------------------------------------------------------------------------------------------
@dataclass
class Benchmark:
    name: str
    module: str  # benchmarks.<module>: run with `python -m`, its `summarize(rows) -> lines` gives the summary cell
    full: list[str] | None  # arguments in full mode (None: not run)
    quick: list[str] | None  # arguments with --quick (None: not run)
    timeout: dict  # {True: seconds with --quick, False: full}
    what: str

    def summarize(self, rows: list[dict]) -> list[str]:
        return importlib.import_module(f"benchmarks.{self.module}").summarize(rows)


BENCHMARKS = [
    Benchmark("memory", "memory", [], [], {True: 240, False: 600},
              "train state and compiled step bytes per device against the mesh (no training)"),
    Benchmark("overhead", "overhead", [], ["--rounds", "3", "--steps", "10"], {True: 240, False: 900},
              "jaxpar's step vs a hand-written jax.jit step"),
    Benchmark("collectives", "collectives", [], ["--model", "mlp", "--steps", "10", "--rounds", "2"],
              {True: 240, False: 900}, "allreduce algorithms: collectives vs theory, steps/s"),
    Benchmark("fsdp", "collectives", ["--fsdp"], ["--fsdp", "--steps", "5", "--rounds", "1"],
              {True: 300, False: 1200}, "FSDP (ZeRO-3) traffic on 5 meshes vs theory"),
    Benchmark("compression", "compression", [], [], {True: 240, False: 600},
              "gradient codecs: bytes on the data axis from the compiled step against each codec's count"),
    Benchmark("compression_cost", "compression_convergence", ["--part", "cost"],
              ["--part", "cost", "--tasks", "mlp", "--rounds", "3", "--per-round", "10"], {True: 300, False: 900},
              "gradient codecs: steps/s against the uncompressed exchange on mesh 8, alternating rounds"),
    Benchmark("comm", "comm", ["--model", "transformer"], [], {True: 300, False: 1200},
              "collective bytes against theory for every strategy and mesh (compiled steps, no training)"),
    Benchmark("strategies", "strategies", [], ["--task", "mlp", "--max-steps", "160"], {True: 300, False: 1500},
              "update strategies with a straggler: steps and simulated time to a target loss"),
    Benchmark("largebatch", "largebatch", [], ["--epochs", "5", "--seeds", "0", "--batches", "32,256,1024"],
              {True: 300, False: 1500}, "large-batch recipes on digits: test accuracy"),
    Benchmark("pipeline", "pipeline", [], [], {True: 120, False: 300},
              "pipeline schedules: activation memory of 1F1B and GPipe against the microbatch count (no training)"),
    Benchmark("stages", "stages", [], ["--parts", "memory,bubble,speed", "--rounds", "2", "--steps", "3"],
              {True: 300, False: 1500}, "the pipelined transformer: equivalence (full mode), memory and bubble "
              "against M, stage=4 against data=4 steps/s"),
    Benchmark("context", "context", [], ["--parts", "balance,traffic,speed", "--rounds", "2", "--steps", "3"],
              {True: 300, False: 2400}, "the seq axis: causal balance, bytes over seq against theory, seq=4 "
              "against data=4 steps/s; memory at --seq-len 4096 for seq=1..8 (full mode)"),
    Benchmark("replica_compute", "replica_compute", [], None, {True: 0, False: 600},
              "FLOPs, temporaries and collective bytes per device of the explicit strategies on "
              "data=2,fsdp=2,model=2 against Sync() (full mode only; no training)"),
    Benchmark("checkpoint", "checkpoint", [], None, {True: 0, False: 900},
              "cost of checkpointing every 10 steps (full mode only)"),
    Benchmark("simulator", "simulator", [], ["--rounds", "1"], {True: 60, False: 120},
              "the event simulator SSP / ASP plan with: seconds for 20,000 updates with stragglers and jitter"),
    Benchmark("data_reads", "data_reads", [], ["--steps", "100"], {True: 180, False: 300},
              "bytes of the text corpus each process reads: 1 process against 2 (no training)"),
    Benchmark("ray_async", "ray_async", ["--steps", "400"], None, {True: 0, False: 900},
              "--runtime ray: asp / ssp2 / sync wall time with a 3x straggler of 4, the server's round trip"),
    Benchmark("pipeline_memory", "pipeline_memory", [], ["--configs", "small", "--schedules", "gpipe,1f1b",
                                                         "--microbatches", "4,16"], {True: 240, False: 1800},
              "the pipelined transformer's compiled temporaries and counted FLOPs per device against M (no training)"),
    Benchmark("pipeline_profile", "pipeline_profile", [], ["--configs", "small", "--schedules", "gpipe,1f1b",
                                                           "--microbatches", "4"], {True: 240, False: 900},
              "the pipeline schedules' compute per device from a jax.profiler trace against the counted FLOPs"),
    Benchmark("ray_async_compute", "ray_async", ["--batch", "2048", "--steps", "400"], None, {True: 0, False: 900},
              "--runtime ray as ray_async with a step's compute above Ray's round trip (global batch 2,048)"),
    Benchmark("input_pipeline", "input_pipeline", [], ["--sizes", "512,4096", "--seconds", "0.3", "--rounds", "3",
                                                       "--steps", "50"], {True: 240, False: 600},
              "host ms per global batch (old per-example index path vs vectorized); mlp steps/s fed by run.py's "
              "pipeline vs device-resident batches"),
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
        return shlex.join(["python", "-m", f"benchmarks.{self.bench.module}", *self.argv])

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


def run(result: Result, timeout: float) -> None:
    """Runs one benchmark as a subprocess of this Python, cwd the repository root, within `timeout` seconds."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # a killed run still leaves what it printed
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", f"benchmarks.{result.bench.module}", *result.argv], cwd=ROOT,
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
        except Exception as error:  # keys changed, or the module does not import: say so, keep the rows in the file
            result.summary = [f"could not summarise its JSON rows: {type(error).__name__}: {error}"]


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
