"""Filesystem checks of the paths a run writes (metrics file, TensorBoard and checkpoint folders) and reads."""

from __future__ import annotations

import json
import os
import tempfile

from jaxpar.io.data import path_kind


def same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def is_or_inside(path: str, folder: str) -> bool:
    """`path` is `folder` or somewhere below it (links resolved)."""
    return same_file(path, folder) or os.path.realpath(path).startswith(
        os.path.realpath(folder).rstrip(os.sep) + os.sep)


def metrics_check(name, path):
    """Static checks of the metrics path; whether its folder really takes a file is probed when the run opens it
    (`jaxpar.io.metrics.JsonlFile`)."""
    if not path:
        return f"{name} {path!r}: empty path; pass a file name such as run.jsonl, or omit {name} to write none"
    kind = path_kind(path)
    if kind.startswith("a dangling"):
        return f"{name} {path!r}: is {kind}; pass the link's target or a new file name such as run.jsonl"
    if os.path.isdir(path):
        return f"{name} {path!r}: not a writable file path (a folder); pass e.g. {os.path.join(path, 'run.jsonl')}"
    if kind not in ("nothing", "a regular file"):
        return f"{name} {path!r}: is {kind}, not a regular file; pass a file name such as run.jsonl"
    parent = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(parent):
        return f"{name} {path!r}: folder {parent!r} does not exist; create it or pass e.g. run.jsonl"
    if not os.access(parent, os.W_OK):
        return f"{name} {path!r}: not a writable file path (folder {parent!r} is not writable); pass e.g. run.jsonl"
    if kind == "a regular file" and not is_metrics_file(path):
        return (f"{name} {path!r}: exists and is not a jaxpar metrics file (its first line is not a config record); "
                f"pass a new file name, or delete the file first")


def writable_folder(example: str):
    """The check of a folder the run writes into: an existing writable folder, or a new one in a writable folder."""
    def check(name, path):
        if not path:
            return f"{name} {path!r}: empty path; pass a folder such as {example}"
        if os.path.exists(path) and not os.path.isdir(path):
            return f"{name} {path!r}: is {path_kind(path)}, not a folder; pass a folder such as {example}"
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.exists(path) and not os.path.isdir(parent):
            return f"{name} {path!r}: folder {parent!r} does not exist; create it or pass e.g. {example}"
        target = path if os.path.exists(path) else parent
        if not os.access(target, os.W_OK | os.X_OK):
            return f"{name} {path!r}: folder {os.path.abspath(target)!r} is not writable; pass a writable folder"

    return check


PROFILE_FOLDER = "profile"  # --profile's folder next to --metrics (or in the working folder) without --tensorboard


def profile_folder(config) -> str:
    """Where --profile writes: --profile-dir; else the --tensorboard folder (TensorBoard's profile plugin reads it
    there); else `profile/` next to the --metrics file; else `profile/` in the working folder."""
    if config.profile_dir:
        return config.profile_dir
    if config.tensorboard:
        return config.tensorboard
    if config.metrics:
        return os.path.join(os.path.dirname(config.metrics), PROFILE_FOLDER)
    return PROFILE_FOLDER


def is_metrics_file(path) -> bool:
    """Empty, or its first line is the JSON config record a run writes first (so re-running overwrites safely)."""
    try:
        with open(path, "rb") as handle:
            first = handle.readline(1 << 20)
    except OSError:
        return True  # not readable: the write probe decides
    if not first.strip():
        return True
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and "versions" in record


TRACE_SUBFOLDER = os.path.join("plugins", "profile")  # where jax.profiler writes inside the --profile-dir folder


def trace_folder(example: str):
    """The check of the folder --profile writes into, before anything trains: `writable_folder`'s, then the folders
    the trace will create (`TRACE_SUBFOLDER`) are probed: what exists of them must be folders, and a temporary
    folder is made (and removed) in the deepest that exists (a read-only file system, a folder even root may not
    write)."""
    def check(name, path):
        problem = writable_folder(example)(name, path)
        if problem:
            return problem
        target = os.path.join(path, TRACE_SUBFOLDER)
        existing = target
        while not os.path.lexists(existing):
            existing = os.path.dirname(existing) or "."
        if not os.path.isdir(existing):
            return (f"{name} {path!r}: {existing!r} is {path_kind(existing)}, not a folder (the trace is written into "
                    f"{target!r}); pass another folder such as {example}")
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".jaxpar-probe-", dir=existing))
        except OSError as error:
            return (f"{name} {path!r}: cannot create folders in {os.path.abspath(existing)!r} ({error.strerror}); "
                    f"pass a writable folder such as {example}")

    return check
