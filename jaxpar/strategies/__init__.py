"""How data replicas agree on parameters. Each strategy is a small object of pure functions (see `base.py`);
`REGISTRY` names the built-in ones."""

from jaxpar.strategies.base import BN_LOCAL, BN_SYNC, Expected, Plan, StepContext, Strategy, Variant
from jaxpar.strategies.local_sgd import DiLoCo, LocalSGD
from jaxpar.strategies.stale import ASP, SSP
from jaxpar.strategies.sync import Sync

__all__ = ["ASP", "BN_LOCAL", "BN_SYNC", "DiLoCo", "Expected", "LocalSGD", "Plan", "REGISTRY", "SSP", "StepContext",
           "Strategy", "Sync", "Variant"]

REGISTRY = {cls.name: cls for cls in (Sync, LocalSGD, DiLoCo, SSP, ASP)}
