"""`StepPricer`: a trainer's compiled step variants priced on a hardware profile (`Trainer(hardware=...)`).

Each variant's `StepCost` (compute, communication, overlap: `codecs.compiled_step_cost`) is read from the program the
trainer compiles before the variant first runs on a batch shape (the trainer tells it: `compiled`), or compiled
ahead of time when the strategy's clock asks for a variant that has not run yet (`cost`: a meeting priced before the
first meeting); the latest batch shape's cost is kept per variant (`costs`). It also chooses the strategy as it runs
on the profile: a torus2d grid follows the profile's nodes (`topology.aligned`). `import jaxpar` registers it with
the trainer (`jaxpar.train.pricer`), which knows nothing of hardware profiles.
"""

from __future__ import annotations

from jaxpar.cost import codecs, strategy_costs
from jaxpar.cost.hardware import Profile, StepCost, parse_hardware
from jaxpar.cost.topology import aligned


class StepPricer:
    """Prices the step variants of the trainer it is attached to on `profile`."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.costs: dict[str, StepCost] = {}  # variant -> its StepCost (the latest batch shape it compiled for)
        self._trainer = None

    @classmethod
    def for_hardware(cls, hardware) -> StepPricer | None:
        """The pricer of a `hardware` argument (a profile, a name, a file or a spec: `parse_hardware`), or None."""
        profile = parse_hardware(hardware)
        return None if profile is None else cls(profile)

    def strategy_for(self, strategy, mesh):
        return aligned(strategy, mesh, self.profile)

    def attach(self, trainer) -> None:
        self._trainer = trainer

    def compiled(self, variant: str, compiled) -> None:
        self.price(variant, compiled)

    def price(self, variant: str, compiled) -> StepCost:
        """The cost of `compiled`, a compiled step `variant` of the trainer, kept as that variant's."""
        trainer = self._trainer
        expected = strategy_costs.theory(trainer.strategy, variant, 0)
        gradients = any(e.what == "gradients" for e in expected)
        cost = codecs.compiled_step_cost(trainer, compiled, gradients, bool(expected), self.profile)
        self.costs[variant] = cost
        return cost

    def cost(self, variant: str) -> StepCost:
        """The `StepCost` of step `variant` (compiled ahead of time if it has not run yet)."""
        if variant not in self.costs:
            self.price(variant, self._trainer.compiled_step(variant))
        return self.costs[variant]


def profile_of(trainer) -> Profile | None:
    """The hardware profile `trainer` is priced on (None: none given)."""
    return getattr(getattr(trainer, "pricer", None), "profile", None)
