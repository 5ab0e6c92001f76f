"""--help text of an option: its declared help, what it applies to and its default."""

from __future__ import annotations

from typing import Any

from jaxpar.cli import strategies
from jaxpar.cli.config import OPTIONS, Config
from jaxpar.cli.defaults import MODEL_OF


def _allreduce_default() -> str:
    """What no --allreduce means, asked of the strategies: the compiler's averaging where replicas share one step."""
    others: dict = {}
    for name, cls in strategies.CLASSES.items():
        if name not in strategies.WHOLE_BATCH:
            others.setdefault(cls.DEFAULT_ALLREDUCE, []).append(name)
    return (f"none given: {' / '.join(strategies.WHOLE_BATCH)} leaves the averaging to XLA's partitioner, " +
            ", ".join(f"{' / '.join(names)} use {algorithm}" for algorithm, names in others.items()))


def describe(name: str) -> str:
    """The full help text of an option: its declared help, what it applies to and its default."""
    option, default = OPTIONS[name], Config.__dataclass_fields__[name].default
    models, applies_to = MODEL_OF.get(name), strategies.APPLIES_TO.get(name)
    notes = []
    if models is not None:
        notes.append(f"{' / '.join(models)} only")
    if applies_to is not None and len(applies_to) < len(strategies.NAMES):
        notes.append(f"--strategy {' / '.join(applies_to)} only")
    if name == "allreduce":
        notes.append(f"default: {_allreduce_default()}")
    elif option.default_text is not None:
        notes.append(f"default: {option.default_text}")
    elif applies_to is not None:  # the strategies' own defaults
        by_value: dict[Any, list[str]] = {}
        for strategy in applies_to:
            by_value.setdefault(strategies.option_default(strategy, name), []).append(strategy)
        notes.append("default: " + (f"{next(iter(by_value))}" if len(by_value) == 1 else
                                    ", ".join(f"{v} for {' / '.join(s)}" for v, s in by_value.items())))
    elif models is not None:
        values = set(map(repr, models.values()))
        notes.append("default: " + (str(next(iter(models.values()))) if len(values) == 1 else
                                    ", ".join(f"{v} for {m}" for m, v in models.items())))
    elif default is not None:
        notes.append(f"default: {default}")
    return option.help + (f" ({'; '.join(notes)})" if notes else "")
