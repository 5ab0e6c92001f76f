"""The non-finite guard's price in collectives: checked before the update, it asks no axis the gradients were
averaged over (data), and at most one 4-byte all-reduce over the axes parameters are split over (fsdp, model),
which no formulation avoids (docs/faults.md). The baseline is the same step with the reduction of the check
removed (the loss, replicated, is still checked: that costs nothing). On the old code (the updated state checked
after the update) these pass too: the new check moved before the update without a new collective."""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar.cost.hlo import collective_ops
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.train import faults
from tests.helpers import batch_for, trainer_for


def compiled_collectives(monkeypatch, mesh, strategy, skip, guarded):
    with monkeypatch.context() as patch:
        if not guarded:
            patch.setattr(faults, "_all_finite", lambda *args, **kwargs: jnp.bool_(True))
        trainer = trainer_for("transformer", mesh, strategy=strategy, skip_nonfinite=skip)
        compiled = trainer.compiled_step("sync", batch_for("transformer", 16))
    return collective_ops(compiled, trainer.mesh)


def over_data(ops):
    return sorted((op.kind, op.axes, op.bytes) for op in ops if mesh_lib.REPLICA_AXIS in (op.axes or ()))


def within_replica_bytes(ops):
    return sum(op.bytes for op in ops if op.axes and mesh_lib.REPLICA_AXIS not in op.axes)


@pytest.mark.parametrize("skip", [True, False], ids=["skip", "abort"])
@pytest.mark.parametrize("mesh,strategy", [("8", None), ("8", jaxpar.Sync("psum"))], ids=["compiler", "psum"])
@pytest.mark.slow
def test_on_data_parallel_meshes_the_guard_adds_no_collective(monkeypatch, mesh, strategy, skip):
    guarded = compiled_collectives(monkeypatch, mesh, strategy, skip, True)
    bare = compiled_collectives(monkeypatch, mesh, strategy, skip, False)
    assert Counter((op.kind, op.axes, op.bytes) for op in guarded) == \
           Counter((op.kind, op.axes, op.bytes) for op in bare)


@pytest.mark.parametrize("mesh,strategy", [("2x4", None), ("data=2,fsdp=2,model=2", None), ("4x2", jaxpar.Sync("ring"))],
                         ids=["2x4-compiler", "fsdp-model-compiler", "4x2-ring"])
@pytest.mark.slow
def test_on_split_parameters_the_guard_costs_four_bytes_within_the_replica_and_nothing_over_data(
        monkeypatch, mesh, strategy):
    """Where parameters are split within a replica (model, fsdp) the flag needs one scalar all-reduce over those
    axes (benchmarks/guard_collectives.py shows no formulation avoids it); the compiler may then combine the
    step's other all-reduces differently (`2x4`: one more instruction, the same bytes). Over data: nothing."""
    guarded = compiled_collectives(monkeypatch, mesh, strategy, True, True)
    bare = compiled_collectives(monkeypatch, mesh, strategy, True, False)
    assert over_data(guarded) == over_data(bare)
    assert within_replica_bytes(guarded) == within_replica_bytes(bare) + 4
    assert len(guarded) - len(bare) in (1, 2)


def test_a_skipped_server_update_is_no_new_version():
    """SSP: a NaN in one replica's rows skips the whole update: parameters, optimizer state and the version buffer
    stay bit-identical and the version counter does not advance (the step counter does)."""
    trainer = trainer_for("mlp", "4x2", strategy=jaxpar.SSP(1, horizon=4))
    state = trainer.init(0)
    before = jax.device_get((state.params, state.opt_state, state.strategy_state))
    batch = batch_for("mlp", size=16)
    batch["image"][4:8] = np.nan  # replica 1's rows
    state, metrics = trainer.step(state, batch, 0)
    assert float(metrics["skipped"]) == 1.0 and int(state.step) == 1
    after = jax.device_get((state.params, state.opt_state, state.strategy_state))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    state, metrics = trainer.step(state, batch_for("mlp", size=16), 1)
    assert float(metrics["skipped"]) == 0.0 and int(state.strategy_state["version"]) == 1


@pytest.mark.parametrize("skip", [True, False], ids=["skip", "abort"])
def test_under_skip_the_optimizer_runs_under_a_conditional_and_nothing_selects_the_state(skip):
    """The old guard computed the update, checked it, then selected every state array between old and new; under
    skip the optimizer now runs only when the gradients are finite (one `conditional`, no select of the
    parameters); abort applies the update unconditionally and only flags it."""
    trainer = trainer_for("mlp", "8", skip_nonfinite=skip)
    text = trainer.compiled_step("sync", batch_for("mlp", 16)).as_text()
    entry = text[text.index("ENTRY"):]
    kernel_shape = "f32[64,32]"  # the hidden layer's kernel (TINY mlp), replicated on mesh 8
    selects = [line for line in entry.splitlines() if "select" in line and line.split("=")[1].strip().startswith(
        kernel_shape)]
    assert ("conditional(" in entry) == skip
    assert selects == []
