"""How data replicas agree on parameters. Each strategy is a small object of pure functions (the `Strategy`
protocol in `base.py`); `clock.py`, `simulation.py` and `stragglers.py` are the simulated clock they run on.

Each strategy class declares its own facts once: `OPTIONS` (the config fields specific to it and their defaults;
`COMMON_OPTIONS` apply to every strategy) and `local_statistics` (replicas compute on their own slice, so
BatchNorm statistics are per replica). Config and the CLI read these and never decide them again.
"""

from jaxpar.strategies.base import BN_LOCAL, BN_SYNC, Plan, StepContext, Strategy, StrategyBase, Variant
from jaxpar.strategies.local_sgd import DiLoCo, LocalSGD
from jaxpar.strategies.stale import ASP, SSP
from jaxpar.strategies.sync import Sync

__all__ = ["ASP", "BN_LOCAL", "BN_SYNC", "COMMON_OPTIONS", "DiLoCo", "LocalSGD", "Plan", "REGISTRY", "SSP",
           "StepContext", "Strategy", "StrategyBase", "Sync", "Variant", "WHOLE_BATCH", "from_config",
           "option_default"]

REGISTRY = {cls.name: cls for cls in (Sync, LocalSGD, DiLoCo, SSP, ASP)}
# Strategies whose step, with no allreduce given, is one jit over the whole global batch (the compiler averages,
# BatchNorm sees the global batch); the others compute on each replica's slice.
WHOLE_BATCH = tuple(name for name, cls in REGISTRY.items() if cls.DEFAULT_ALLREDUCE is None)
# Config fields every strategy accepts, with their defaults (None: allreduce = the partitioner's for sync, psum
# for the others; torus = the divisor nearest the square root; stragglers = nobody slow).
COMMON_OPTIONS = {"allreduce": None, "torus": None, "stragglers": None}


def option_default(strategy: str, field: str):
    """The default of a strategy option (KeyError if `field` does not apply to `strategy`)."""
    return {**COMMON_OPTIONS, **REGISTRY[strategy].OPTIONS}[field]


def from_config(config) -> Strategy:
    """The strategy a (validated) `jaxpar.Config` asks for; unset (None) options take the strategy's defaults."""
    cls = REGISTRY[config.strategy]
    options = {f: (getattr(config, f) if getattr(config, f) is not None else option_default(config.strategy, f))
               for f in {**COMMON_OPTIONS, **cls.OPTIONS}}
    return cls.from_options(options, config.steps)
