"""`Trainer.fit` runs periodic actions; running out of batches or a failing action ends it with a FitError that
carries the last state, which is not lost to donation."""

import itertools

import jax
import numpy as np
import optax
import pytest

import jaxpar
from jaxpar.train import actions
from tests.helpers import batch_for, trainer_for


class Record(jaxpar.Action):
    def __init__(self, every, at_end=False, needs_state=False):
        self.every, self.at_end, self.needs_state = every, at_end, needs_state
        self.seen = []

    def __call__(self, event):
        step_in_state = None if event.state is None else int(jax.device_get(event.state.step))
        self.seen.append((event.step, step_in_state, event.last, round(event.metrics["loss"], 6)))


def batches(model="mlp"):
    return (batch_for(model, seed=n % 3) for n in itertools.count())


def test_actions_run_at_their_period_with_state_when_they_need_it():
    trainer = trainer_for("mlp", "2x4")
    every3, state_every4, end_only = Record(3), Record(4, needs_state=True), Record(0, at_end=True)
    losses = []
    state = trainer.fit(trainer.init(0), batches(), 10, actions=[every3, state_every4, end_only],
                        on_step=lambda step, m: losses.append(round(m["loss"], 6)))
    assert [s for s, *_ in every3.seen] == [3, 6, 9]
    assert [(s, in_state) for s, in_state, *_ in state_every4.seen] == [(4, 4), (8, 8)]  # the state after that step
    assert end_only.seen[0][:3] == (10, None, True) and len(end_only.seen) == 1  # no state asked for, none given
    assert [loss for *_, loss in every3.seen] == [losses[2], losses[5], losses[8]]
    assert int(state.step) == 10 and len(losses) == 10


def test_evaluate_action_sees_the_state_of_its_step():
    trainer = trainer_for("mlp", "2x4")
    held_out = batch_for("mlp", size=16, seed=9)
    evaluation = actions.Evaluate(lambda tr, st: {k: float(v) for k, v in tr.evaluate(st, held_out).items()},
                                  every=2)
    state = trainer.fit(trainer.init(0), batches(), 5, actions=[evaluation])
    assert [s for s, _ in evaluation.history] == [2, 4, 5]
    assert evaluation.history[-1][1]["loss"] == pytest.approx(float(trainer.evaluate(state, held_out)["loss"]))


def test_running_out_of_batches_is_a_fit_error_with_a_usable_state():
    trainer = trainer_for("mlp", "2x4")
    seen = Record(1)
    with pytest.raises(jaxpar.FitError, match=r"the batch iterator ran out after 3 steps of 5") as info:
        trainer.fit(trainer.init(0), [batch_for("mlp")] * 3, 5, actions=[seen])
    assert info.value.step == 3 and [s for s, *_ in seen.seen] == [1, 2, 3]  # metrics of every finished step
    state = info.value.state
    assert int(state.step) == 3
    state, metrics = trainer.step(state, batch_for("mlp"))  # not donated: training goes on from it
    assert int(state.step) == 4


class Boom(jaxpar.Action):
    every = 2

    def __call__(self, event):
        raise RuntimeError("disk full")


def test_a_failing_action_is_a_fit_error_naming_it_with_a_usable_state():
    trainer = trainer_for("mlp", "2x4")
    with pytest.raises(jaxpar.FitError, match=r"action Boom failed at step 2: RuntimeError: disk full") as info:
        trainer.fit(trainer.init(0), batches(), 6, actions=[Boom()])
    assert isinstance(info.value.__cause__, RuntimeError)
    state = info.value.state
    assert int(state.step) == info.value.step >= 2
    trainer.step(state, batch_for("mlp"))


def test_divergence_action_stops_with_one_line():
    trainer = trainer_for("mlp", "2x4", optimizer=optax.sgd(1e30), skip_nonfinite=False)
    with pytest.raises(jaxpar.FitError, match=r"^training diverged: loss is nan at step \d+; lower the learning rate$"):
        trainer.fit(trainer.init(0), batches(), 20, actions=[actions.StopIfDiverged()])


def test_a_refused_batch_is_a_fit_error_too():
    trainer = trainer_for("mlp", "4x2")
    with pytest.raises(jaxpar.FitError, match=r"global batch size 10 does not divide") as info:
        trainer.fit(trainer.init(0), [batch_for("mlp")] * 2 + [batch_for("mlp", size=10)], 3)
    assert int(info.value.state.step) == 2
    assert np.isfinite(trainer.params(info.value.state)["hidden"]["kernel"]).all()


def test_fit_copies_a_steps_metrics_to_the_host_only_when_an_action_is_due(monkeypatch):
    """A step whose metrics no action reads leaves them on the device (reading costs the host tens of us per
    metric on a 1 ms step); the ones that are due get the same metrics as before."""
    from jaxpar.train import loop

    reads = []
    real = loop.host_metrics
    monkeypatch.setattr(loop, "host_metrics", lambda m, p: reads.append(1) or real(m, p))
    trainer = trainer_for("mlp", "2x4")
    state = trainer.fit(trainer.init(0), batches(), 8)
    assert reads == []
    every_four = Record(4)
    trainer.fit(state, batches(), 8, actions=[every_four])
    assert len(reads) == 2 and [seen[0] for seen in every_four.seen] == [12, 16]
    assert all(np.isfinite(seen[3]) for seen in every_four.seen)
