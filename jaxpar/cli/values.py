"""Each option's own value check: `CHECKS[field]` gets (shown name, a given value) and returns the one-line error or
None (a parser check may raise a JaxparError itself). Integers go through `jaxpar.checks`."""

from __future__ import annotations

import math
import re
from typing import Any, Callable

from jaxpar.errors import ShardingError
from jaxpar.parallel.partitioning import normalize_rules
from jaxpar.checks import int_problem, is_int
from jaxpar.cli import paths
from jaxpar.cli.options import APPLIES_TO, MODELS, STRATEGIES, strategy_default
from jaxpar.strategies import BN_LOCAL, BN_SYNC
from jaxpar.cost.hardware import parse_hardware
from jaxpar.cost.simulator import parse_stragglers
from jaxpar.errors import ConfigError
from jaxpar.parallel.collectives import check_allreduce
from jaxpar.parallel.compression import parse_codec
from jaxpar.parallel.mesh import parse_mesh_spec
from jaxpar.pipeline.config import SCHEDULES
from jaxpar.train.remat import REMATS
from jaxpar.train.lr_schedules import LR_SCALINGS, LR_SCHEDULES, parse_batch_ramp

Check = Callable[[str, Any], "str | None"]
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
    """The partitioner's own reading of rules (`normalize_rules`) decides what is valid; said as the config field."""
    try:
        normalize_rules(rules)
    except ShardingError:
        return (f"{name} {rules!r}: must map logical axis names to a mesh axis name, a tuple of them, or None (a dict,"
                f" or a Flax-style list of (logical name, mesh axis) pairs)")


def channels_check(name, value):
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(is_int(c) and c >= 1 for c in value)):
        return f"{name} {value!r}: must be two positive integers, e.g. (16, 32)"


def finite_check(name, value):
    """Float fields: finite, and (an int from a config file) representable as a float."""
    try:
        ok = math.isfinite(float(value))
    except OverflowError:
        return f"{name} {_short(value)}: too large for a float; {_example(name)}"
    if not ok:
        return f"{name} {value!r}: must be a finite number; {_example(name)}"


def _example(name) -> str:
    from jaxpar.cli.config import Config  # (the declarations import this module)

    field_name = name.lstrip("-").replace("-", "_")
    default = Config.__dataclass_fields__[field_name].default
    if default is None and field_name in APPLIES_TO:
        default = strategy_default(APPLIES_TO[field_name][0], field_name)
    return f"e.g. {name} {default}" if default is not None else "pass a finite number"


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


CHECKS: dict[str, tuple[Check, ...]] = {
    "mesh": (parses(parse_mesh_spec),),
    "rules": (rules_check,),
    "pipeline": (one_of(SCHEDULES, noun="pipeline schedule"),),
    "microbatches": (at_least(1),),
    "repeats": (at_least(1),),
    "model": (one_of(MODELS, noun="model"),),
    "dtype": (one_of(DTYPES),),
    "dropout": (within(lambda v: 0 <= v < 1, "must be in [0, 1)"),),
    "layers": (at_least(1),), "d_model": (at_least(1),), "heads": (at_least(1),), "d_ff": (at_least(1),),
    "seq_len": (at_least(2),),
    "vocab": (at_least(2), within(lambda v: v >= 256, "byte-level text needs a vocabulary of at least 256")),
    "hidden": (at_least(1),),
    "channels": (channels_check,),
    "bn": (one_of((BN_SYNC, BN_LOCAL)),),
    "batch_size": (at_least(1),),
    "optimizer": (one_of(OPTIMIZERS),),
    "lr": (within(lambda v: v > 0, "must be > 0, e.g. --lr 1e-3"),),
    "weight_decay": (within(lambda v: v >= 0, "must be >= 0"),),
    "lr_schedule": (one_of(LR_SCHEDULES),),
    "warmup_steps": (at_least(0),),
    "lr_decay_steps": (parses(parse_decay_steps),),
    "lr_decay_factor": (within(lambda v: 0 < v <= 1, "must be in (0, 1], e.g. 0.1"),),
    "strategy": (one_of(STRATEGIES, noun="strategy"),),
    "allreduce": (parses(lambda value: check_allreduce(value, None)),),
    "torus": (at_least(1),),
    "compress": (parses(parse_codec),),
    "sync_period": (at_least(1),),
    "local_after": (at_least(0),),
    "outer_lr": (within(lambda v: v > 0, "must be > 0, e.g. --outer-lr 0.7"),),
    "outer_momentum": (within(lambda v: 0 <= v < 1, "must be in [0, 1), e.g. 0.9"),),
    "staleness": (at_least(0),),
    "stragglers": (parses(parse_stragglers),),
    "hardware": (not_empty("a100-nvlink"), parses(parse_hardware)),
    "lr_scaling": (one_of(LR_SCALINGS),),
    "base_batch_size": (at_least(1),),
    "batch_ramp": (parses(parse_batch_ramp),),
    "grad_accum": (at_least(1),),
    "label_smoothing": (within(lambda v: 0 <= v < 1, "must be in [0, 1), e.g. 0.1"),),
    "steps": (at_least(1),),
    "seed": (within(lambda v: 0 <= v < 2 ** 32, "must be in [0, 2**32)"),),
    "log_every": (at_least(1),),
    "remat": (one_of(REMATS, noun="remat policy"),),
    "devices": (at_least(1),),
    "metrics": (paths.metrics_check,),
    "tensorboard": (paths.writable_folder("runs/"),),
    "profile": (parses(parse_profile),),
    "profile_dir": (paths.writable_folder("profile/"),),
    "eval_every": (at_least(0),),
    "eval_batches": (at_least(0),),
    "checkpoint_dir": (paths.writable_folder("checkpoints/"),),
    "checkpoint_every": (at_least(1),),
    "keep": (at_least(1),),
    "resume": (one_of(("auto", "required")),),
    "resume_step": (at_least(0),),
    "on_nonfinite": (one_of(("skip", "abort")),),
    "max_skips": (at_least(0),),
    "check_every": (at_least(0),),
    "coordinator": (within(_coordinator, "must be HOST:PORT, e.g. 10.0.0.1:1234"),),
    "num_processes": (at_least(1),),
    "process_id": (at_least(0),),
}
