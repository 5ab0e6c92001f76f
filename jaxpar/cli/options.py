"""The option framework: how a `Config` field is declared, and what applies to which model and strategy.

A field is declared in `config.py` on one line, `name: type = section(default, "help")`; the rest of what is known
about an option sits in small tables keyed by field name: here (which models and strategies it applies to, read
from `models.REGISTRY` and `jaxpar.strategies.REGISTRY`; config-file-only fields; how --help states a default that is
not a plain value), in `values.CHECKS` (its own value check) and `validation` (checks across fields).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import models
from jaxpar.cli import strategies as strategies_lib

GROUPS = ("mesh", "pipeline", "architecture", "dataset", "optimizer", "strategy", "large batch", "run",
          "checkpoints and faults", "processes")
PRIMARY = ("model", "strategy")  # fields the others' applicability depends on  [field names, not mesh axes]
MODELS = models.MODELS
STRATEGIES = strategies_lib.NAMES

# field -> {model: its default there}, for the fields that apply to some models only (None: derived, see `defaults`)
MODEL_OF: dict[str, dict[str, Any]] = {}
for _model, _spec in models.REGISTRY.items():
    for _name, _default in _spec.defaults.items():
        MODEL_OF.setdefault(_name, {})[_model] = _default

APPLIES_TO = strategies_lib.APPLIES_TO  # field -> the strategies it applies to

FILE_ONLY = ("rules", "channels")  # config-file fields that are no flag
CONST = {"resume": "auto"}  # the value of a flag given without one (`--resume` = `--resume auto`)
_DIGITS_MODELS = [m for m, s in models.REGISTRY.items() if s.dataset == models.registry.DIGITS]
DEFAULT_TEXT = {  # how --help states a default that is not a plain value
    "bn": "sync, or local under a strategy whose replicas compute on their own slice",
    "data": "the Python standard library's .py files",
    "lr_decay_steps": "50% and 75% of --steps",
    "torus": "the divisor of the data-axis size nearest its square root",
    "stragglers": "none given: every replica is equally fast",
    "hardware": "none: every step costs 1, communication is free",
    "base_batch_size": "the first global batch size",
    "resume": "off",
    "profile_dir": "the --tensorboard folder; else profile/ next to --metrics; else ./profile",
    "coordinator": "one process, or from the environment (jaxpar.launch, SLURM)",
}
WHY = {  # a hint added to the "does not apply to --model" error
    "bn": "only the " + " / ".join(m for m, s in models.REGISTRY.items() if "bn" in s.defaults) + " has BatchNorm",
    "data": f"{' and '.join(_DIGITS_MODELS)} train on the built-in digits dataset",
}


def section(group: str) -> Callable[..., Any]:
    """The declarer of one group's fields: `declare(default, help)` -> a dataclass field."""
    assert group in GROUPS, group

    def declare(default, help: str):
        return dataclasses.field(default=default, metadata={"help": help, "group": group})

    return declare


def shown(name: str) -> str:
    """How errors name a field: its flag, or the bare field name for config-file-only fields."""
    return name if name in FILE_ONLY else "--" + name.replace("_", "-")


def strategy_default(strategy: str, name: str):
    """The default of strategy option `name` under `strategy` (what None means there)."""
    return strategies_lib.option_default(strategy, name)
