"""The local launcher: N processes of one program on this machine, joined by JAX's distributed runtime.

    python -m jaxpar.launch --nproc 2 -- run.py --mesh 2x4 --steps 100
    python -m jaxpar.launch --nproc 2 --devices-per-process 4 -- my_train.py      # a script of your own

Each process gets the coordinator address (127.0.0.1 and a free port), the process count and its rank in the
environment (`JAXPAR_COORDINATOR`, `JAXPAR_NUM_PROCESSES`, `JAXPAR_PROCESS_ID`), which `run.py` and
`jaxpar.runtime.distributed.initialize()` read. `run.py` gives each process mesh size / N CPU devices itself; for another
script pass `--devices-per-process` (sets `JAXPAR_LOCAL_DEVICES`). An inherited XLA CPU device count is removed.

- Output: every line of a process's stdout and stderr is written with its rank in front, `[0] step 10/100 ...`
  (gloo's "Rank k is connected to n peer ranks" start-up lines are left out).
- Signals: SIGINT (Ctrl-C) and SIGTERM are passed to every process as SIGTERM, so a run with `--checkpoint-dir`
  saves a checkpoint after an agreed step and exits 0; a second Ctrl-C kills them all.
- Failure: when a process exits with an error or is killed, the launcher names it, stops the others (SIGTERM, then
  SIGKILL after `--grace` seconds) and exits with that process's code (128 + signal when killed). The processes
  run in their own session, so no process outlives the launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxpar.runtime.distributed import port_problem
from jaxpar.checks import int_problem

# gloo prints "[Gloo] Rank k is connected to n peer ranks. Expected number of connected peer ranks is : n" from
# several threads at once, so its pieces arrive interleaved across lines
NOISE = re.compile(r"\[Gloo\]\s*|Rank\s+\d*\s*|\d*\s*is connected to\s*\d*\s*|\d*\s*peer ranks\.\s*|"
                   r"Expected number of connected peer ranks is\s*:\s*\d*")
STOPPED_CODES = (130, 143)  # run.py's exit codes after Ctrl-C / SIGTERM without a checkpoint
DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child_environment(rank: int, count: int, port: int, devices: int | None, base=None) -> dict:
    env = dict(os.environ if base is None else base)
    flags = DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env.update(JAXPAR_COORDINATOR=f"127.0.0.1:{port}", JAXPAR_NUM_PROCESSES=str(count), JAXPAR_PROCESS_ID=str(rank),
               PYTHONUNBUFFERED="1")
    if devices:
        env["JAXPAR_LOCAL_DEVICES"] = str(devices)
    else:
        env.pop("JAXPAR_LOCAL_DEVICES", None)
    return env


def _relay(stream, rank: int, out, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if "[Gloo]" in line or "peer ranks" in line or "is connected to" in line:
            cleaned = NOISE.sub("", line)
            if not cleaned.strip(" 0123456789"):
                continue
            line = cleaned
        with lock:
            out.write(f"[{rank}] {line}\n")
            out.flush()
    stream.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Launcher:
    def __init__(self, command: list[str], nproc: int, devices: int | None = None, grace: float = 20.0,
                 port: int | None = None):
        self.command, self.nproc, self.devices, self.grace = command, nproc, devices, grace
        self.port = port or free_port()
        self.processes: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._relays: list[threading.Thread] = []
        self._signals = 0

    def start(self) -> None:
        for rank in range(self.nproc):
            process = subprocess.Popen(self.command, env=child_environment(rank, self.nproc, self.port, self.devices),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            self.processes.append(process)
            for stream, out in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
                relay = threading.Thread(target=_relay, args=(stream, rank, out, self._lock), daemon=True)
                relay.start()
                self._relays.append(relay)

    def forward(self, number, frame) -> None:
        self._signals += 1
        if self._signals > 1 and number == signal.SIGINT:  # a second Ctrl-C: stop now
            self._say("second interrupt: killing every process")
            self.kill_all(signal.SIGKILL)
            return
        self._say(f"{signal.Signals(number).name}: passing SIGTERM to every process (they save a checkpoint if "
                  f"they have --checkpoint-dir, then stop)")
        self.kill_all(signal.SIGTERM)

    def kill_all(self, number) -> None:
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # it ended since poll()
                    os.killpg(process.pid, number)  # its whole session: nothing it started survives

    def _say(self, text: str) -> None:
        with self._lock:
            print(f"jaxpar.launch: {text}", file=sys.stderr, flush=True)

    def wait(self) -> int:
        """Until every process has ended; the first failure stops the others. Returns the exit code."""
        failed = None
        while True:
            codes = [p.poll() for p in self.processes]
            if failed is None:
                failures = [(rank, code) for rank, code in enumerate(codes)
                            if code not in (None, 0) and not (self._signals and code in STOPPED_CODES)]
                if failures:
                    # seen in the same poll: a killed process first (the others' errors usually follow from it)
                    rank, code = failed = min(failures, key=lambda failure: (failure[1] >= 0, failure[0]))
                    if any(c is None for c in codes):
                        self._say(f"process {rank} {_describe(code)}; stopping the other processes")
                        self.kill_all(signal.SIGTERM)
                        deadline = time.monotonic() + self.grace
            if all(c is not None for c in codes):
                break
            if failed is not None and time.monotonic() > deadline:
                self._say(f"processes still running {self.grace:g}s after process {failed[0]} failed: killing them")
                self.kill_all(signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
        for relay in self._relays:
            relay.join(timeout=5)
        if failed is None:
            stopped = [c for c in codes if c]
            if stopped:  # stopped on request without a checkpoint (SIGTERM / Ctrl-C)
                self._say(f"stopped on request: exit codes {codes}")
            return stopped[0] if stopped else 0
        rank, code = failed
        self._say(f"failed: process {rank} of {self.nproc} {_describe(code)}")
        return code if code > 0 else 128 - code


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2, no usage dump
        print(f"jaxpar.launch: error: {message} (see python -m jaxpar.launch --help)", file=sys.stderr)
        sys.exit(2)


def parse(argv) -> argparse.Namespace:
    parser = _Parser(prog="python -m jaxpar.launch",
                                     description="Run a program in N processes on this machine, joined by JAX's "
                                                 "distributed runtime (gloo collectives on CPU).")
    parser.add_argument("--nproc", type=int, required=True, help="number of processes")
    parser.add_argument("--devices-per-process", type=int, default=None,
                        help="CPU devices each process creates (run.py works this out from --mesh itself)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--grace", type=float, default=20.0,
                        help="seconds the others get to stop after one fails, before SIGKILL (default 20)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT.py ARGS...  or  -- -m MODULE ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the program after --, e.g. python -m jaxpar.launch --nproc 2 -- run.py --mesh 2x4")
    for flag, value, problem in (("--nproc", args.nproc, int_problem(args.nproc, 1, why="processes")),
                                 ("--devices-per-process", args.devices_per_process,
                                  int_problem(args.devices_per_process, 1, why="CPU devices")),
                                 ("--port", args.port, port_problem(args.port))):
        problem = None if value is None else problem
        if problem:  # before anything starts: a bad port would otherwise fail in every process
            parser.error(f"{flag} {value}: {problem}")
    args.command = command
    return args


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    script = args.command[0]
    if script != "-m" and not os.path.isfile(script):
        print(f"jaxpar.launch: error: {script!r}: no such file; give a Python script (e.g. run.py) or -m MODULE",
              file=sys.stderr)
        sys.exit(2)
    launcher = Launcher([sys.executable, *args.command], args.nproc, args.devices_per_process, args.grace, args.port)
    previous = {s: signal.signal(s, launcher.forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher.start()
        return launcher.wait()
    finally:
        launcher.kill_all(signal.SIGKILL)  # (none left in a normal end)
        for number, handler in previous.items():
            signal.signal(number, handler)


if __name__ == "__main__":
    sys.exit(main())
