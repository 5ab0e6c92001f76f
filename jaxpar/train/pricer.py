"""What a Trainer asks of whoever prices its steps (`Trainer(hardware=...)`), knowing nothing of hardware itself.

A `Pricer` is made from the `hardware` argument by the factory registered here (`register`; `import jaxpar`
registers `jaxpar.cost.step_pricer.StepPricer`). The trainer lets it choose the strategy as it runs on that hardware,
attaches itself once built, tells it of each step variant's first compilation on a batch shape, and prices the
strategy's clock (`sim_time`) through `cost`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from jaxpar.errors import ConfigError


class Pricer(Protocol):
    def strategy_for(self, strategy, mesh):
        """The strategy as it runs on this hardware (itself, or e.g. a torus2d grid that follows its nodes)."""

    def attach(self, trainer) -> None:
        """The trainer whose steps it prices (built; nothing compiled yet)."""

    def compiled(self, variant: str, compiled) -> None:
        """Step `variant` was compiled for a batch shape for the first time (the program the step then runs)."""

    def cost(self, variant: str) -> Any:
        """The cost of one step of `variant` for the strategy's clock (`Clock.priced`)."""


_factories: list[Callable[[Any], Pricer | None]] = []


def register(factory: Callable[[Any], Pricer | None]) -> None:
    """`factory(hardware) -> Pricer | None` (None: no profile) makes the pricer of every later Trainer."""
    _factories[:] = [factory]


def pricer_for(hardware) -> Pricer | None:
    """The pricer of `hardware` (None: none asked for); a ConfigError when nothing is registered to make one."""
    if hardware is None:
        return None
    if not _factories:
        raise ConfigError(f"hardware {hardware!r}: no step pricer is registered (jaxpar.cost registers one when "
                          f"jaxpar is imported); import jaxpar, or pass hardware=None")
    return _factories[0](hardware)
