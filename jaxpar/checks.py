"""The one check of integer arguments and options, for the library and the CLI alike (and of a file to write).

    check_int("LocalSGD(period=...)", period, 1, "steps between meetings")   # "..." is replaced by the value
    check_int("grad_accum", grad_accum, 1, "microbatches per update")         # shown as "grad_accum 0: ..."
"""

from __future__ import annotations

import numbers
import os

from jaxpar.errors import ConfigError, JaxparError


def is_int(value) -> bool:
    """An integer, not a bool (`period=True` is a mistake, not 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def int_problem(value, low: int, high: int | None = None, why: str = "") -> str | None:
    """What is wrong with `value` as an integer in [low, high) (None: nothing)."""
    if is_int(value) and value >= low and (high is None or value < high):
        return None
    if high is None:
        bound = f"an integer >= {low}"
    else:  # a large power of two reads as one: [0, 2**32)
        shown = f"2**{high.bit_length() - 1}" if high >= 2**31 and high & (high - 1) == 0 else str(high)
        bound = f"an integer in [{low}, {shown})"
    return f"must be {bound}{f' ({why})' if why else ''}"


def check_int(where: str, value, low: int, why: str = "", *, high: int | None = None, optional: bool = False,
              error: type[JaxparError] = ConfigError) -> None:
    """Raises `error` unless `value` is an integer in [low, high) (None too when `optional`).

    `where` names the argument as written: "LocalSGD(period=...)" (the value replaces "...") or "grad_accum"
    (the value follows it).
    """
    if optional and value is None:
        return
    problem = int_problem(value, low, high, why)
    if problem:
        shown = where.replace("...", repr(value)) if "..." in where else f"{where} {value!r}"
        raise error(f"{shown}: {problem}")


def unwritable_file(path: str, flag: str, hint: str) -> str | None:
    """Why `path` cannot be written as a file (None if it can), as one line naming `flag`."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{flag} {path!r}: is a folder; {hint}"
    if not os.path.isdir(folder):
        return f"{flag} {path!r}: the folder {folder!r} does not exist; pass a path in an existing folder"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{flag} {path!r}: cannot be written (permission denied); {hint}"
    return None
