"""The command-line flags of run.py, generated from the option declarations of `jaxpar.cli.Config` (never written by
hand).

Every option declared with `flag=True` (the default) becomes `--option-name` (underscores -> dashes) with the
option's type, help text and default; the flags are listed in --help by group. Flags default to None (= "not
given"), so a flag overrides the config file's option only when it is passed.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import NamedTuple

from jaxpar.cli.config import OPTIONS, Config
from jaxpar.cli.help import describe
from jaxpar.cli.options import GROUPS

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}  # a bool flag takes no value


class Flag(NamedTuple):
    flag: str  # "--batch-size"
    option: str  # "batch_size"
    type: type  # int | float | str
    help: str  # the declared help, with what it applies to and its default
    group: str
    const: object = None  # the value of the flag given alone (None: it needs a value)


def _type_of(f: dataclasses.Field) -> type:
    name = str(f.type).split("|")[0].strip()
    if name not in _TYPES:
        raise TypeError(f"Config.{f.name}: a flag needs an int, float, str or bool option, not {f.type}; "
                        f"declare it with flag=False")
    return _TYPES[name]


FLAGS: list[Flag] = [Flag("--" + f.name.replace("_", "-"), f.name, _type_of(f), describe(f.name),
                          OPTIONS[f.name].group, OPTIONS[f.name].const)
                     for f in dataclasses.fields(Config) if OPTIONS[f.name].flag]


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Adds every flag to `parser`, one argument group per concern."""
    for group in GROUPS:
        flags = [f for f in FLAGS if f.group == group]
        if flags:
            section = parser.add_argument_group(group)
            for f in flags:
                if f.type is bool:
                    section.add_argument(f.flag, dest=f.option, action="store_const", const=True, default=None,
                                         help=f.help.replace("%", "%%"))
                    continue
                optional_value = {} if f.const is None else {"nargs": "?", "const": f.const}
                section.add_argument(f.flag, dest=f.option, type=f.type, default=None,
                                     help=f.help.replace("%", "%%"), **optional_value)


def overrides(args: argparse.Namespace) -> dict:
    """The options the parsed flags set (flags not passed set nothing)."""
    return {f.option: getattr(args, f.option) for f in FLAGS if getattr(args, f.option, None) is not None}
