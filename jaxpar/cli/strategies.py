"""The strategies on the command line: for each strategy class, its own options with their defaults, how a config's
values build it, and what a run with it is told at start-up. Keyed by class; the `--strategy` names are the classes'
`name`. A strategy needs none of this to train: it is what offers it on the CLI."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optax

from jaxpar.strategies import ASP, SSP, DiLoCo, LocalSGD, Strategy, Sync

# Counts that only matter up to the run's length are planned for at least this many steps, so that a resumed run
# that raises --steps within it plans the same (the SSP version buffer, the post-local clock).
PLAN_FLOOR = 64

# Options every strategy accepts, with their defaults (None: allreduce = the partitioner's for sync, psum for the
# others; torus = the divisor nearest the square root; stragglers = nobody slow).
COMMON_OPTIONS = {"allreduce": None, "torus": None, "stragglers": None}


class Adapter(NamedTuple):
    """A strategy class on the command line."""

    options: dict[str, Any]  # its own options -> their defaults (`COMMON_OPTIONS` apply to every strategy)
    build: Callable[[dict, int], Strategy]  # (every option's value, --steps) -> the strategy
    notes: Callable[[Strategy], list[str]] = lambda strategy: []  # what a run with it is told at start-up


def _common(values: dict) -> dict:
    """The keyword arguments every strategy takes, from the common options' values."""
    return {"allreduce": values["allreduce"], "torus_x": values["torus"], "stragglers": values["stragglers"]}


def _local_after(values: dict, steps: int) -> int:
    return min(values["local_after"], max(steps, PLAN_FLOOR))


def _outer(values: dict) -> optax.GradientTransformation:
    return optax.sgd(values["outer_lr"], momentum=values["outer_momentum"], nesterov=True)


def _equally_fast(strategy) -> list[str]:
    """A server strategy without stragglers applies every replica's fresh gradient: sync SGD, said as such."""
    if strategy.stragglers.slowdown or strategy.stragglers.jitter:
        return []
    return [f"strategy {strategy.name} without a straggler profile (--stragglers): every replica is equally fast, "
            f"so every update applies every replica's fresh gradient, as sync SGD does (give a straggler profile to "
            f"see staleness)"]


ADAPTERS: dict[type, Adapter] = {  # the first is the default strategy
    Sync: Adapter({"compress": "none"}, lambda v, steps: Sync(**_common(v), compress=v["compress"])),
    LocalSGD: Adapter({"sync_period": LocalSGD.DEFAULT_PERIOD, "local_after": 0, "compress": "none"},
                      lambda v, steps: LocalSGD(v["sync_period"], _local_after(v, steps), **_common(v),
                                                compress=v["compress"])),
    DiLoCo: Adapter({"sync_period": DiLoCo.DEFAULT_PERIOD, "local_after": 0, "compress": "none",
                     "outer_lr": DiLoCo.DEFAULT_OUTER_LR, "outer_momentum": DiLoCo.DEFAULT_OUTER_MOMENTUM},
                    lambda v, steps: DiLoCo(v["sync_period"], _outer(v), local_after=_local_after(v, steps),
                                            **_common(v), compress=v["compress"])),
    # SSP / ASP plan max(steps, PLAN_FLOOR) updates, so the version buffer is min(S, max(steps, PLAN_FLOOR)) + 1: a
    # resumed run that raises --steps within the floor keeps the buffer its checkpoint holds
    SSP: Adapter({"staleness": 2}, lambda v, steps: SSP(v["staleness"], horizon=max(steps, PLAN_FLOOR), **_common(v)),
                 _equally_fast),
    ASP: Adapter({}, lambda v, steps: ASP(horizon=max(steps, PLAN_FLOOR), **_common(v)), _equally_fast),
}
CLASSES = {cls.name: cls for cls in ADAPTERS}  # --strategy name -> class
NAMES = tuple(CLASSES)
# Strategies whose step, with no allreduce given, is one jit over the whole global batch (the compiler averages,
# BatchNorm sees the global batch); the others compute on each replica's slice.
WHOLE_BATCH = tuple(name for name, cls in CLASSES.items() if cls.DEFAULT_ALLREDUCE is None)
# option -> the strategies it applies to (an option given for another strategy is an error)
APPLIES_TO: dict[str, tuple[str, ...]] = {
    option: tuple(name for name, cls in CLASSES.items() if option in COMMON_OPTIONS or option in ADAPTERS[cls].options)
    for option in dict.fromkeys([*COMMON_OPTIONS, *(o for adapter in ADAPTERS.values() for o in adapter.options)])}


def options_of(name: str) -> dict[str, Any]:
    """Every option strategy `name` accepts -> its default there."""
    return {**COMMON_OPTIONS, **ADAPTERS[CLASSES[name]].options}


def option_default(name: str, option: str):
    """The default of `option` under strategy `name` (KeyError if it does not apply there)."""
    return options_of(name)[option]


def from_config(config) -> Strategy:
    """The strategy a (validated) config asks for; unset (None) options take the strategy's defaults."""
    values = {option: default if getattr(config, option) is None else getattr(config, option)
              for option, default in options_of(config.strategy).items()}
    return ADAPTERS[CLASSES[config.strategy]].build(values, config.steps)


def notes(strategy) -> list[str]:
    """What a run with `strategy` is told at start-up (nothing for a strategy the CLI does not offer)."""
    adapter = ADAPTERS.get(type(strategy))
    return adapter.notes(strategy) if adapter else []
