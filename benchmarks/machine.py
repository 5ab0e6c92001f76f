"""The machine a benchmark run is on: CPU, cores, memory, OS, Python and package versions, git commit, load."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
