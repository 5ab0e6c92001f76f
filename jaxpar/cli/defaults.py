"""Resolution: which fields apply to a config's model and strategy, and the defaults that fill the unset ones."""

from __future__ import annotations

import dataclasses

from jaxpar.cli import strategies as strategies_lib
from jaxpar.cli.config import OPTIONS, Config
from jaxpar.cli.options import APPLIES_TO, strategy_default
from jaxpar.strategies import BN_LOCAL, BN_SYNC


def _bn(config: Config) -> str:
    """BatchNorm statistics follow the strategy: local when replicas compute on their own slice."""
    return BN_LOCAL if strategies_lib.from_config(config).local_statistics else BN_SYNC


DERIVED = {"bn": _bn}  # defaults computed from the rest of the (resolved) config


def applies(config: Config, name: str) -> bool:
    """Whether field `name` applies to the config's model and strategy."""
    models = OPTIONS[name]["models"]
    if models is not None and config.model not in models:
        return False
    return name not in APPLIES_TO or config.strategy in APPLIES_TO[name]


def default(config: Config, name: str):
    """What field `name` is when not given, for this config's model and strategy (None: it does not apply)."""
    if not applies(config, name):
        return None
    if OPTIONS[name]["models"] is not None:
        return OPTIONS[name]["models"][config.model]
    if name in APPLIES_TO:
        return strategy_default(config.strategy, name)
    return Config.__dataclass_fields__[name].default


def given(config: Config, name: str) -> bool:
    """Set to something other than its default (by a flag or a config file)."""
    value = getattr(config, name)
    return value is not None and value != default(config, name)


def resolved(config: Config) -> Config:
    """A copy with every unset (None) field that applies replaced by its default; fields that do not apply stay
    None. Strategy options take the strategy's own defaults."""
    changes = {name: default(config, name) for name in OPTIONS if getattr(config, name) is None}
    out = dataclasses.replace(config, **{k: v for k, v in changes.items() if v is not None})
    derived = {k: DERIVED[k](out) for k in changes if k in DERIVED and applies(config, k)}
    return dataclasses.replace(out, **derived) if derived else out
