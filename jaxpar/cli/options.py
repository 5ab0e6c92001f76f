"""How an option of `Config` is declared, and how it is read back.

An option is declared once, on its line in `config.py`: `name: type = group(default, "help", check=...)`, where
`group = section("optimizer")` gives the declarer of one group's options. The declaration holds the option's
default, help, value checks, whether it is a flag, and how --help states a default that is not a plain value; which
models and strategies it applies to comes from `models.REGISTRY` and `jaxpar.cli.strategies` (`defaults`).
`declared(config)` reads every declaration back, `shown(config, name)` is how a message names an option.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

GROUPS = ("mesh", "pipeline", "architecture", "dataset", "optimizer", "strategy", "large batch", "run",
          "checkpoints and faults", "processes")

Check = Callable[[str, Any], "str | None"]  # (the option as shown, a given value) -> the one-line error, or None


class Option(NamedTuple):
    """What an option's declaration says besides its name, type and default."""

    help: str  # --help text (what it applies to and its default are added: `jaxpar.cli.help`)
    group: str  # one of GROUPS
    checks: tuple[Check, ...] = ()  # each given value's own checks (`jaxpar.cli.values`)
    flag: bool = True  # False: set in a config file only (no flag: the value is no int, float, str or bool)
    const: Any = None  # the value of the flag given alone (`--resume` = `--resume auto`); None: it takes a value
    default_text: str | None = None  # how --help states a default that is not a plain value


def section(group: str) -> Callable[..., Any]:
    """The declarer of one group's options: `declare(default, help, check=..., ...)` -> a dataclass field."""
    assert group in GROUPS, group

    def declare(default, help: str, *, check: Check | tuple[Check, ...] = (), flag: bool = True, const=None,
                default_text: str | None = None):
        checks = check if isinstance(check, tuple) else (check,)
        option = Option(help, group, checks, flag, const, default_text)
        return dataclasses.field(default=default, metadata={"option": option})

    return declare


@functools.cache
def _declared(cls) -> dict[str, Option]:
    return {f.name: f.metadata["option"] for f in dataclasses.fields(cls)}


def declared(config) -> dict[str, Option]:
    """Every option of a config (or its class) -> its declaration, in declaration order."""
    return _declared(config if isinstance(config, type) else type(config))


def default_of(config, name: str):
    """The declared default of option `name` (None: "not given"; what that means is `defaults.default`)."""
    cls = config if isinstance(config, type) else type(config)
    return cls.__dataclass_fields__[name].default


def shown(config, name: str) -> str:
    """How messages name option `name`: its flag, or the bare name of an option set in a config file only."""
    return "--" + name.replace("_", "-") if declared(config)[name].flag else name
