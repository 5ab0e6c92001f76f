"""Where the test suite's time goes: a pytest plugin that records, for every test, the CPU and wall time of the pytest
process and what JAX spent in it (tracing to a jaxpr, lowering to MLIR, XLA's compilation, reading the persistent
compilation cache, and the cache's hits and misses), and a summary by test file.

    pytest -p benchmarks.suite_profile                # each pytest process writes suite-profile/<pid>.json
    python -m benchmarks.suite_profile [FOLDER]       # the totals, and the files that cost the most CPU

`JAXPAR_SUITE_PROFILE` names another folder; a run replaces the profile of the run before. Only the pytest
processes are measured, not the processes the tests start (run.py, launched processes, Ray actors). JAX's durations
are wall time inside a process: with more pytest workers than cores they include waiting for a core, and XLA
compiles on threads of its own, so a compile's wall time and the process's CPU time do not add up.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time

import pytest

FOLDER = os.environ.get("JAXPAR_SUITE_PROFILE", "suite-profile")
DURATIONS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
             "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
             "/jax/core/compile/backend_compile_duration": "compile_s",
             "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read_s"}
EVENTS = {"/jax/compilation_cache/cache_hits": "cache_hits", "/jax/compilation_cache/cache_misses": "cache_misses"}
COLUMNS = ["cpu_s", "wall_s", "trace_s", "lower_s", "compile_s", "cache_read_s", "cache_hits", "cache_misses"]

_tests: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_current: list[str] = []


def _on_duration(event: str, seconds: float, **_) -> None:
    if _current and event in DURATIONS:
        _tests[_current[0]][DURATIONS[event]] += seconds


def _on_event(event: str, **_) -> None:
    if _current and event in EVENTS:
        _tests[_current[0]][EVENTS[event]] += 1


def pytest_configure(config) -> None:
    from jax import monitoring

    if not hasattr(config, "workerinput"):  # the lone pytest process, or xdist's controller before its workers start
        for stale in glob.glob(os.path.join(FOLDER, "*.json")):  # one run's profile, not several runs' mixed
            os.remove(stale)

    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[:] = [item.nodeid]
    cpu, wall = time.process_time(), time.perf_counter()
    yield
    _tests[item.nodeid]["cpu_s"] += time.process_time() - cpu
    _tests[item.nodeid]["wall_s"] += time.perf_counter() - wall
    _current.clear()


def pytest_sessionfinish(session) -> None:
    if _tests:
        os.makedirs(FOLDER, exist_ok=True)
        with open(os.path.join(FOLDER, f"{os.getpid()}.json"), "w") as out:
            json.dump(_tests, out)


def load(folder: str) -> dict[str, collections.Counter]:
    tests: dict[str, collections.Counter] = {}
    for path in glob.glob(os.path.join(folder, "*.json")):
        with open(path) as f:
            tests.update({name: collections.Counter(row) for name, row in json.load(f).items()})
    return tests


def table(tests: dict[str, collections.Counter], top: int = 25) -> list[str]:
    files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, row in tests.items():
        files[name.split("::")[0]].update(row)
    total = sum(files.values(), collections.Counter())
    lines = [f"{len(tests)} tests in {len(files)} files", "| file | " + " | ".join(COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 1) + "|"]
    for name, row in [("all", total)] + sorted(files.items(), key=lambda kv: -kv[1]["cpu_s"])[:top]:
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:.1f}" if c.endswith("_s") else str(int(row[c]))
                                                 for c in COLUMNS) + " |")
    return lines


def main(argv: list[str]) -> int:
    folder = argv[0] if argv else FOLDER
    tests = load(folder)
    if not tests:
        print(f"suite_profile: no profile in {folder!r}; run `pytest -p benchmarks.suite_profile` first",
              file=sys.stderr)
        return 2
    print("\n".join(table(tests)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
