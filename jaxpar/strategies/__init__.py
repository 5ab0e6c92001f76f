"""How data replicas agree on parameters. Each strategy is a small object of pure functions (see `base.py`)."""

from jaxpar.strategies.base import Strategy, StepContext
from jaxpar.strategies.sync import Sync

__all__ = ["Strategy", "StepContext", "Sync"]
