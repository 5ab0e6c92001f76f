"""The trainer's pricing hook (`jaxpar.train.pricer`): the Trainer knows nothing of hardware profiles; the pricer
registered for `Trainer(hardware=...)` (jaxpar.cost's `StepPricer` once jaxpar is imported) chooses the strategy, is
told of each step variant's first compilation and prices `sim_time`. With none registered, hardware is one error
line."""

import pytest

from jaxpar.cost.hardware import StepCost
from jaxpar.cost.step_pricer import StepPricer
from jaxpar.errors import ConfigError
from jaxpar.train import pricer
from tests.helpers import batch_for, trainer_for


class Flat:
    """A pricer of a user's own: every step costs 2 s of compute and 0.5 s of communication."""

    def __init__(self, hardware):
        self.hardware, self.seen, self.trainer = hardware, [], None

    def strategy_for(self, strategy, mesh):
        return strategy

    def attach(self, trainer):
        self.trainer = trainer

    def compiled(self, variant, compiled):
        self.seen.append((variant, type(compiled).__name__))

    def cost(self, variant):
        return StepCost(compute=2.0, comm=0.5)


def test_import_jaxpar_registers_the_cost_analysers_pricer():
    trainer = trainer_for("mlp", "8", hardware="a100-nvlink")
    assert isinstance(trainer.pricer, StepPricer) and trainer.pricer.profile.name == "a100-nvlink"
    assert trainer_for("mlp", "8").pricer is None  # no hardware: nothing priced, every step costs 1


def test_a_registered_pricer_sees_each_first_compilation_and_prices_sim_time(monkeypatch):
    monkeypatch.setattr(pricer, "_factories", [])
    pricer.register(Flat)
    trainer = trainer_for("mlp", "8", hardware="my cluster")
    assert isinstance(trainer.pricer, Flat) and trainer.pricer.trainer is trainer
    assert trainer.pricer.hardware == "my cluster"
    state, batch, times = trainer.init(0), batch_for("mlp"), []
    for _ in range(3):
        state, metrics = trainer.step(state, batch)
        times.append(metrics["sim_time"])
    assert times == [2.5, 5.0, 7.5]
    assert trainer.pricer.seen == [("sync", "Compiled")]  # told once: the first compilation on this batch shape


def test_hardware_without_a_registered_pricer_is_one_error_line(monkeypatch):
    monkeypatch.setattr(pricer, "_factories", [])
    with pytest.raises(ConfigError, match=r"^hardware 'a100-nvlink': no step pricer is registered \(jaxpar.cost "
                                          r"registers one when jaxpar is imported\); import jaxpar, or pass "
                                          r"hardware=None$"):
        trainer_for("mlp", "8", hardware="a100-nvlink")
