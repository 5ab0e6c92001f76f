"""A strategy of the user's own that implements only the core (`jaxpar.strategies.Strategy`: name, init, reduce,
shardings, steps, plan): the example in the protocol's docstring, run as written, trains through `Trainer` like
`Sync()`, and `jaxpar.explain` prices it as the cost table says of a strategy it does not know.

Tolerances: the same single-jit computation over the global batch as `Sync()`'s, losses rtol 1e-6 and parameters
atol / rtol 1e-6 after 5 steps (float32; the programs may differ in fusion, not in math; on jax 0.10.2 on CPU both
meshes give bit-identical parameters)."""

import inspect
import textwrap

import jax
import numpy as np
import pytest

import jaxpar
from jaxpar.cost import strategy_costs
from jaxpar.strategies import Strategy
from tests.helpers import batch_for, trainer_for

TOLERANCE = 1e-6


def user_strategy_class():
    """The class the `Strategy` docstring's example defines, run as written."""
    doc = inspect.cleandoc(Strategy.__doc__)
    after = doc.split("::\n", 1)[1].splitlines()
    code = []
    for line in after:
        if line.strip() and not line.startswith("    "):
            break
        code.append(line)
    namespace: dict = {}
    exec(textwrap.dedent("\n".join(code)), namespace)  # noqa: S102 (our own docstring)
    return namespace["PerStepSync"]


PerStepSync = user_strategy_class()


def run(strategy, mesh, steps=5):
    trainer = trainer_for("mlp", mesh, strategy=strategy)
    state = trainer.init(0)
    losses, metrics = [], {}
    for step in range(steps):
        state, metrics = trainer.step(state, batch_for("mlp", size=16, seed=step))
        losses.append(float(metrics["loss"]))
    return trainer, state, losses, metrics


def test_the_example_implements_only_the_core():
    members = {name for name in vars(PerStepSync) if not name.startswith("__")}
    assert members == {"name", "init", "reduce", "shardings", "steps", "plan"}


@pytest.mark.parametrize("mesh", ["8", "2x4"])
def test_a_user_strategy_of_the_core_only_trains_like_sync(mesh):
    trainer, state, losses, metrics = run(PerStepSync(), mesh)
    reference, reference_state, reference_losses, reference_metrics = run(jaxpar.Sync(), mesh)
    np.testing.assert_allclose(losses, reference_losses, rtol=TOLERANCE)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE),
                 trainer.params(state), reference.params(reference_state))
    assert int(state.step) == 5 and set(trainer.variants) == {"step"}
    # no clock of its own: no sim_time (Sync's is the step count); the trainer guards its unguarded step
    assert "sim_time" not in metrics and float(reference_metrics["sim_time"]) == 5.0
    assert float(metrics["skipped"]) == 0.0
    assert trainer.ctx.communicator is None  # no communicator: the compiler's averaging


def test_explain_prices_a_user_strategy_like_sync_and_says_so():
    batch = batch_for("mlp", size=16)
    trainer = trainer_for("mlp", "2x4", strategy=PerStepSync(), hardware="a100-ib100")
    report = jaxpar.explain(trainer, batch)
    assert report["assumed"] == strategy_costs.assumption(trainer.strategy)
    assert report["assumed"].startswith("strategy 'per_step_sync' is not in jaxpar.cost.strategy_costs: priced "
                                        "like sync (every step variant averages a gradient-sized tree over the "
                                        "replica axis once per step)")
    sync = jaxpar.explain(trainer_for("mlp", "2x4", hardware="a100-ib100"), batch)
    assert "assumed" not in sync
    [own] = report["variants"].values()
    assert list(report["variants"]) == ["step"] and own["share"] == 1.0  # its plan picks "step" every time
    # the same theory over data as sync's, every collective explained by it, the same compiled communication
    assert own["theory"] == sync["variants"]["sync"]["theory"] and own["unexpected"] == 0
    assert own["busiest_sent"] == sync["variants"]["sync"]["busiest_sent"]
    assert report["projection"]["per_step_sync"]["seconds"] == pytest.approx(own["projected_seconds"]["step"])
    text = jaxpar.format_explain(report)
    assert text.splitlines()[1] == f"assumed: {report['assumed']}"
    assert "0 collective(s) not explained by theory" in text


def test_the_cost_table_keys_by_class_with_subclasses_taking_their_bases_entry():
    assert strategy_costs.costs_of(jaxpar.DiLoCo()) is strategy_costs.TABLE[jaxpar.LocalSGD]
    assert strategy_costs.costs_of(PerStepSync) is strategy_costs.DEFAULT
    assert strategy_costs.assumption(jaxpar.ASP()) is None
    with pytest.raises(jaxpar.ConfigError, match=r"^strategy 'per_step_sync': its variants' shares are counted from "
                                                 r"its plan, which needs the trainer's context; pass trainer.ctx$"):
        strategy_costs.variant_shares(PerStepSync())
    own = strategy_costs.SYNC_COSTS._replace(shares=lambda strategy, ctx: {"step": 1.0})
    strategy_costs.register(PerStepSync, own)
    try:
        assert strategy_costs.variant_shares(PerStepSync()) == {"step": 1.0}
        assert strategy_costs.assumption(PerStepSync()) is None
    finally:
        del strategy_costs.TABLE[PerStepSync]
