"""Resolution: which options apply to a config's model and strategy, and the defaults that fill the unset ones.

Model-specific options and their defaults come from `models.REGISTRY`, strategy options from
`jaxpar.cli.strategies`; every other option applies everywhere with its declared default."""

from __future__ import annotations

import dataclasses
from typing import Any

import models
from jaxpar.cli import strategies
from jaxpar.cli.options import declared, default_of
from jaxpar.strategies import BN_LOCAL, BN_SYNC

# option -> {model: its default there}, for the options that apply to some models only (None: derived, `DERIVED`)
MODEL_OF: dict[str, dict[str, Any]] = {}
for _model, _spec in models.REGISTRY.items():
    for _name, _default in _spec.defaults.items():
        MODEL_OF.setdefault(_name, {})[_model] = _default
# model -> {option: its default there}
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {model: {name: by_model[model] for name, by_model in MODEL_OF.items()
                                                     if model in by_model} for model in models.MODELS}


def _bn(config) -> str:
    """BatchNorm statistics follow the strategy: local when replicas compute on their own slice."""
    return BN_LOCAL if strategies.from_config(config).local_statistics else BN_SYNC


DERIVED = {"bn": _bn}  # defaults computed from the rest of the (resolved) config


def applies(config, name: str) -> bool:
    """Whether option `name` applies to the config's model and strategy."""
    if name in MODEL_OF and config.model not in MODEL_OF[name]:
        return False
    return name not in strategies.APPLIES_TO or config.strategy in strategies.APPLIES_TO[name]


def default(config, name: str):
    """What option `name` is when not given, for this config's model and strategy (None: it does not apply)."""
    if not applies(config, name):
        return None
    if name in MODEL_OF:
        return MODEL_OF[name][config.model]
    if name in strategies.APPLIES_TO:
        return strategies.option_default(config.strategy, name)
    return default_of(config, name)


def given(config, name: str) -> bool:
    """Set to something other than its default (by a flag or a config file)."""
    value = getattr(config, name)
    return value is not None and value != default(config, name)


def resolved(config):
    """A copy with every unset (None) option that applies replaced by its default; options that do not apply stay
    None. Strategy options take the strategy's own defaults."""
    changes = {name: default(config, name) for name in declared(config) if getattr(config, name) is None}
    out = dataclasses.replace(config, **{k: v for k, v in changes.items() if v is not None})
    derived = {k: DERIVED[k](out) for k in changes if k in DERIVED and applies(config, k)}
    return dataclasses.replace(out, **derived) if derived else out
