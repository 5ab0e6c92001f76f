"""How data replicas agree on parameters. Each strategy is a small object of pure functions (the `Strategy`
protocol in `base.py`); `clock.py`, `simulation.py` and `stragglers.py` are the simulated clock they run on.
`REGISTRY` names the built-in ones."""

from jaxpar.strategies.base import BN_LOCAL, BN_SYNC, Plan, StepContext, Strategy, StrategyBase, Variant
from jaxpar.strategies.local_sgd import DiLoCo, LocalSGD
from jaxpar.strategies.stale import ASP, SSP
from jaxpar.strategies.sync import Sync

__all__ = ["ASP", "BN_LOCAL", "BN_SYNC", "DiLoCo", "LocalSGD", "Plan", "REGISTRY", "SSP", "StepContext", "Strategy",
           "StrategyBase", "Sync", "Variant"]

REGISTRY = {cls.name: cls for cls in (Sync, LocalSGD, DiLoCo, SSP, ASP)}
