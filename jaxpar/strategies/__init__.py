"""How data replicas agree on parameters. Each strategy is a small object of pure functions (see `base.py`).

Each strategy class declares its own facts once: `OPTIONS` (the config fields specific to it and their defaults;
`COMMON_OPTIONS` apply to every strategy) and `local_statistics` (replicas compute on their own slice, so
BatchNorm statistics are per replica). Config, the CLI and experiment read these and never decide them again.
"""

from jaxpar.strategies.base import Plan, StepContext, Strategy
from jaxpar.strategies.local_sgd import DiLoCo, LocalSGD
from jaxpar.strategies.stale import ASP, SSP
from jaxpar.strategies.sync import Sync

__all__ = ["ASP", "SSP", "DiLoCo", "LocalSGD", "Plan", "StepContext", "Strategy", "Sync", "REGISTRY",
           "COMMON_OPTIONS", "from_config", "option_default"]

REGISTRY = {cls.name: cls for cls in (Sync, LocalSGD, DiLoCo, SSP, ASP)}
# Config fields every strategy accepts, with their defaults (None: allreduce = the partitioner's for sync, psum
# for the others; torus = the divisor nearest the square root; stragglers = nobody slow).
COMMON_OPTIONS = {"allreduce": None, "torus": None, "stragglers": None}


def option_default(strategy: str, field: str):
    """The default of a strategy option (KeyError if `field` does not apply to `strategy`)."""
    return {**COMMON_OPTIONS, **REGISTRY[strategy].OPTIONS}[field]


def from_config(config) -> Strategy:
    """The strategy a (validated) `jaxpar.Config` asks for; unset (None) options take the strategy's defaults."""
    import optax

    name = config.strategy
    value = {f: (getattr(config, f) if getattr(config, f) is not None else option_default(name, f))
             for f in {**COMMON_OPTIONS, **REGISTRY[name].OPTIONS}}
    common = {"torus_x": value["torus"], "stragglers": value["stragglers"]}
    if name == "sync":
        return Sync(value["allreduce"], **common)
    common["allreduce"] = value["allreduce"] or "psum"
    if name == "local_sgd":
        return LocalSGD(value["sync_period"], value["local_after"], **common)
    if name == "diloco":
        outer = optax.sgd(value["outer_lr"], momentum=value["outer_momentum"], nesterov=True)
        return DiLoCo(value["sync_period"], outer, local_after=value["local_after"], **common)
    if name == "ssp":
        return SSP(value["staleness"], horizon=config.steps, **common)
    return ASP(horizon=config.steps, **common)
