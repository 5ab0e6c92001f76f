"""The checks and parsers of option values. A check gets (the option as shown, a given value) and returns the
one-line error or None (a parser check may raise a JaxparError itself); each option's declaration in `config.py` names
its checks. Integers go through `jaxpar.checks`."""

from __future__ import annotations

import math
import re
from typing import Any, Callable

from jaxpar.checks import int_problem, is_int
from jaxpar.cli.options import Check
from jaxpar.errors import ConfigError, ShardingError
from jaxpar.parallel.partitioning import normalize_rules

OPTIMIZERS = ("adamw", "sgd", "momentum")
DTYPES = ("float32", "bfloat16")


def at_least(low: int, high: int | None = None) -> Check:
    def check(name, value):
        problem = int_problem(value, low, high)
        return f"{name} {value!r}: {problem}" if problem else None

    return check


def within(test: Callable[[Any], bool], text: str) -> Check:
    return lambda name, v: None if test(v) else f"{name} {v!r}: {text}"


def one_of(choices, noun: str | None = None) -> Check:
    listed = ", ".join(choices)
    if noun:
        return lambda name, v: None if v in choices else f"{name} {v!r} is not a {noun}; choose one of {listed}"
    return lambda name, v: None if v in choices else f"{name} {v!r}: choose one of {listed}"


def parses(parse: Callable[[Any], Any]) -> Check:
    """A check by a parser that raises a JaxparError naming the flag itself."""
    def check(name, value):
        parse(value)

    return check


def not_empty(example: str) -> Check:
    return lambda name, v: None if str(v).strip() else f"{name} {v!r}: empty; pass e.g. {name} {example}, or omit it"


def rules_check(name, rules):
    """The partitioner's own reading of rules (`normalize_rules`) decides what is valid; said as the option."""
    try:
        normalize_rules(rules)
    except ShardingError:
        return (f"{name} {rules!r}: must map logical axis names to a mesh axis name, a tuple of them, or None (a dict,"
                f" or a Flax-style list of (logical name, mesh axis) pairs)")


def channels_check(name, value):
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(is_int(c) and c >= 1 for c in value)):
        return f"{name} {value!r}: must be two positive integers, e.g. (16, 32)"


def finite_check(name, value, example=None):
    """Float options: finite, and (an int from a config file) representable as a float; `example`: a value that
    works (the option's default)."""
    hint = f"e.g. {name} {example}" if example is not None else "pass a finite number"
    try:
        ok = math.isfinite(float(value))
    except OverflowError:
        return f"{name} {_short(value)}: too large for a float; {hint}"
    if not ok:
        return f"{name} {value!r}: must be a finite number; {hint}"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


def parse_decay_steps(text) -> tuple[int, ...]:
    parts = [p.strip() for p in str(text).split(",")]
    if not all(re.fullmatch(r"[0-9]+", p) for p in parts) or [int(p) for p in parts] != sorted({int(p) for p in parts}):
        raise ConfigError(f"--lr-decay-steps {text!r}: must be increasing step numbers, e.g. 1000,2000")
    return tuple(int(p) for p in parts)


def parse_profile(text) -> tuple[int, int]:
    """--profile START:STOP -> (START, STOP): the trace covers the steps from START updates done to STOP."""
    match = re.fullmatch(r"\s*([0-9]+)\s*:\s*([0-9]+)\s*", str(text))
    if not match or int(match.group(1)) >= int(match.group(2)):
        raise ConfigError(f"--profile {text!r}: must be START:STOP, step numbers with 0 <= START < STOP (the trace "
                          f"covers the updates from step START to step STOP), e.g. --profile 2:4")
    return int(match.group(1)), int(match.group(2))


def _coordinator(value) -> bool:
    return isinstance(value, str) and value.count(":") >= 1 and value.rsplit(":", 1)[1].isdigit()


coordinator_check = within(_coordinator, "must be HOST:PORT, e.g. 10.0.0.1:1234")
