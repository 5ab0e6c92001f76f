"""How data replicas agree on parameters. Each strategy is a small object of pure functions (see `base.py`)."""

from jaxpar.strategies.base import Plan, StepContext, Strategy
from jaxpar.strategies.local_sgd import DiLoCo, LocalSGD
from jaxpar.strategies.stale import ASP, SSP
from jaxpar.strategies.sync import Sync

__all__ = ["ASP", "SSP", "DiLoCo", "LocalSGD", "Plan", "StepContext", "Strategy", "Sync"]


def from_config(config) -> Strategy:
    """The strategy a (validated) `jaxpar.Config` asks for."""
    import optax

    common = {"allreduce": config.allreduce or "psum", "torus_x": config.torus, "stragglers": config.stragglers}
    if config.strategy == "sync":
        return Sync(config.allreduce, torus_x=config.torus, stragglers=config.stragglers)
    if config.strategy == "local_sgd":
        return LocalSGD(config.sync_period or 4, config.local_after or 0, **common)
    if config.strategy == "diloco":
        outer = optax.sgd(config.outer_lr if config.outer_lr is not None else 0.7,
                          momentum=config.outer_momentum if config.outer_momentum is not None else 0.9, nesterov=True)
        return DiLoCo(config.sync_period or 4, outer, local_after=config.local_after or 0, **common)
    if config.strategy == "ssp":
        return SSP(config.staleness if config.staleness is not None else 2, horizon=config.steps, **common)
    return ASP(horizon=config.steps, **common)
