"""What fits a device (`jaxpar.cost.memory_fit`, `explain(..., fit=True)`, `run.py --explain`): per remat policy the
compiled memory and FLOPs, the largest batch, and a suggestion that holds when compiled."""

import jax
import numpy as np
import optax
import pytest

import jaxpar
import models
import run
from jaxpar.cost import memory_fit as fit
from jaxpar.train.remat import REMATS
from tests.helpers import TINY


def transformer(mesh="2", **kw):
    return jaxpar.Trainer(model=models.factory(TINY["transformer"].replace(layers=2)),
                          loss_fn=models.LOSSES["transformer"], optimizer=optax.adamw(1e-3),
                          mesh=jaxpar.make_mesh(mesh), **kw)


def batch_of(trainer, rows):
    seq = TINY["transformer"].seq_len
    return {"tokens": jax.ShapeDtypeStruct((rows, seq + 1), np.int32)}


def test_largest_batch_is_the_last_multiple_of_the_unit_under_the_line_through_two_points():
    # 1,000 bytes fixed + 100 per row: 10,000 bytes hold 90 rows, in units of 8 -> 88
    assert fit.largest_batch(10, 2_000, 20, 3_000, 10_000, 8) == 88
    assert fit.largest_batch(10, 2_000, 20, 3_000, 1_700, 8) is None  # not even 8 rows fit (1,800 bytes)
    assert fit.largest_batch(10, 2_000, 20, 2_000, 10_000, 8) is None  # memory does not grow with the batch


def test_batch_unit_covers_the_batch_axes_the_replicas_accumulation_and_microbatches():
    assert fit.batch_unit(transformer("2x4")) == 2 and fit.batch_unit(transformer("fsdp=8")) == 8
    assert fit.batch_unit(transformer("data=2,fsdp=2,model=2", grad_accum=3)) == 12  # lcm(4, 2 x 3)


@pytest.fixture(scope="module")
def measured():
    """Each policy's compiled memory at 16 rows, from an advice with a budget that fits everything. The other
    budgets below ask the same trainer (`with_budget`), so each program is compiled and measured once here."""
    trainer = transformer(hardware="a100-nvlink")
    return trainer, fit.what_fits(trainer, batch_of(trainer, 16), "sync")


@pytest.fixture(scope="module", autouse=True)
def measured_once():
    """`fit._measure` remembered per (trainer, variant, batch rows, policy) for this module: the same program
    compiles to the same memory, and the advice's decisions are what the tests below check."""
    original, seen = fit._measure, {}

    def remembered(trainer, variant, inputs, batch, policy):
        key = (id(trainer), variant, fit._rows(batch), policy)
        if key not in seen:
            seen[key] = original(trainer, variant, inputs, batch, policy)
        return seen[key]

    fit._measure = remembered
    yield
    fit._measure = original


def with_budget(monkeypatch, budget):
    monkeypatch.setattr(fit, "budget_of", lambda trainer: (int(budget), "a test's budget"))


@pytest.mark.slow
def test_each_policy_is_compiled_under_its_own_remat(measured):
    _, advice = measured
    p = advice["policies"]
    assert list(p) == list(REMATS)
    assert advice["budget"] == 80e9 and advice["budget_source"] == "the a100-nvlink profile"
    # full remat keeps fewer bytes and recomputes: more FLOPs; every policy's memory grows with the batch
    assert p["full"]["temporaries"] < p["none"]["temporaries"]
    assert p["full"]["flops_per_device"] > 1.1 * p["none"]["flops_per_device"]
    assert all(q["bytes_at_double"] > q["bytes"] and q["fits"] for q in p.values())
    # everything fits: the least recompute wins, and the largest batch is the one of the leanest policy
    s = advice["suggestion"]
    assert s["remat"] == "none" and s["batch"] == 16
    leanest = max(p, key=lambda n: p[n]["largest_batch"])
    # millions of rows: estimated on the line through the two compiled batches, not compiled
    assert s["largest"]["remat"] == leanest and s["largest"]["batch"] > fit.VERIFY_UP_TO * 16
    assert not s["largest"]["compiled"] and s["largest"]["bytes"] <= 80e9


@pytest.mark.slow
def test_a_budget_between_the_policies_suggests_the_cheapest_that_fits(measured, monkeypatch):
    trainer, before = measured
    p = before["policies"]
    budget = (p["none"]["bytes"] + min(q["bytes"] for q in p.values())) // 2  # none does not fit, the leanest does
    with_budget(monkeypatch, budget)
    advice = fit.what_fits(trainer, batch_of(trainer, 16), "sync")
    fitting = [n for n, q in advice["policies"].items() if q["bytes"] <= budget]
    assert "none" not in fitting and fitting
    cheapest = min(fitting, key=lambda n: advice["policies"][n]["flops_per_device"])
    assert advice["suggestion"]["remat"] == cheapest and advice["suggestion"]["batch"] == 16
    largest = advice["suggestion"]["largest"]  # a few times this batch: compiled, and it fits
    assert largest["compiled"] and 16 < largest["batch"] <= fit.VERIFY_UP_TO * 16 and largest["bytes"] <= budget


@pytest.mark.slow
def test_a_batch_that_fits_no_policy_gets_a_smaller_batch_that_does_when_compiled(measured, monkeypatch):
    trainer, before = measured
    p = before["policies"]
    budget = min(q["bytes"] for q in p.values()) - 1  # 16 rows fit under no policy
    with_budget(monkeypatch, budget)
    advice = fit.what_fits(trainer, batch_of(trainer, 16), "sync")
    s = advice["suggestion"]
    assert not any(q["fits"] for q in advice["policies"].values())
    assert s["compiled"] and 2 <= s["batch"] < 16 and s["batch"] % 2 == 0 and s["bytes"] <= budget
    again = trainer.compiled_step("sync", batch_of(trainer, s["batch"]), remat=s["remat"]).memory_analysis()
    total = (again.argument_size_in_bytes + again.output_size_in_bytes - again.alias_size_in_bytes
             + again.temp_size_in_bytes)
    assert total == s["bytes"]


@pytest.mark.slow
def test_a_model_too_big_for_the_budget_is_told_to_split(measured, monkeypatch):
    trainer, _ = measured
    with_budget(monkeypatch, 1000)
    advice = fit.what_fits(trainer, batch_of(trainer, 16), "sync")
    assert advice["suggestion"]["remat"] is None
    assert "split the model over more devices" in advice["suggestion"]["reason"]


@pytest.mark.slow
def test_cli_explain_prints_the_table_and_the_suggestion(capsys):
    assert run.main(["--model", "mlp", "--mesh", "2x4", "--explain", "--hardware", "a100-nvlink,memory=1e9"]) == 0
    out = capsys.readouterr().out
    assert "what fits a device (1,000,000,000 bytes, the a100-nvlink,memory=1e9 profile)" in out
    for name in REMATS:
        assert f"\n  {name} " in out
    assert "suggestion: --remat none at --batch-size 32 (fits this batch" in out


def test_a_bad_memory_in_the_hardware_profile_is_one_line(capsys):
    assert run.main(["--mesh", "2x4", "--explain", "--hardware", "a100-nvlink,memory=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--hardware" in err[0] and "'memory=-1'" in err[0] and "> 0" in err[0]
