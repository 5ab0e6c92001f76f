"""`jaxpar.explain` against hand-computed numbers, and `run.py --explain` / `--hardware` from the command line."""

import pytest
import json

import numpy as np
import optax

import jaxpar
import models
import run
from jaxpar.cost.expected_traffic import expected
from jaxpar.cost.hlo import Collective
from tests.helpers import TINY, batch_for

# The tiny MLP: 8x8 image (64) -> hidden 32 -> 10 classes.
IN, HIDDEN, OUT = 64, 32, 10
PARAMS = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT  # 2,410
BATCH = 128


def mlp_trainer(mesh, strategy=None, hardware=None):
    return jaxpar.Trainer(models.factory(TINY["mlp"]), models.LOSSES["mlp"], optax.adam(1e-3),
                          jaxpar.make_mesh(mesh), strategy=strategy, hardware=hardware)


def by_name(report):
    return {p["name"]: p for p in report["plan"]["parameters"]}


def comm(variant, axes, kind="all-reduce"):
    return [c for c in variant["communication"] if c["axes"] == axes and c["kind"] == kind]


def test_explain_the_mlp_on_2x4_matches_hand_computed_numbers():
    report = jaxpar.explain(mlp_trainer("2x4"), batch_for("mlp", BATCH))
    assert report["parameters"] == PARAMS and report["model_flops_per_token"] is None  # images, not tokens
    plan = by_name(report)
    # Megatron over model=4: hidden column-parallel, out row-parallel; the out bias stays whole
    assert plan["hidden.kernel.value"]["spec"] == "(None, model)" and plan["hidden.kernel.value"]["bytes_per_device"] == IN * 8 * 4
    assert plan["hidden.bias.value"]["bytes_per_device"] == 8 * 4
    assert plan["out.kernel.value"]["spec"] == "(model, None)" and plan["out.kernel.value"]["bytes_per_device"] == 8 * OUT * 4
    assert plan["out.bias.value"]["spec"] == "(None)" and plan["out.bias.value"]["bytes_per_device"] == OUT * 4
    per_device = (IN * 8 + 8 + 8 * OUT) * 4 + OUT * 4  # 2,440
    totals = report["plan"]["per_device"]
    assert totals["parameters"] == {"total": per_device, "replicated": OUT * 4, "sharded": per_device - OUT * 4}
    assert totals["optimizer"]["total"] == 2 * per_device + 4  # adam: mu and nu like the parameters, a count
    sync = report["variants"]["sync"]
    assert sync["share"] == 1.0 and report["variants"].keys() == {"sync"}
    # the gradient all-reduce over data carries each device's gradient shard (+ the loss and accuracy means)
    [over_data] = comm(sync, "data")
    assert over_data["count"] == 1 and per_device <= over_data["bytes"] <= per_device + 8
    [data_theory] = [t for t in sync["theory"] if t["axis"] == "data"]
    assert data_theory["bytes_sent_per_device"] == 2 * (2 - 1) / 2 * per_device and data_theory["steps"] == 2
    assert not [c for c in sync["communication"] if "data" in c["axes"] and c["kind"] != "all-reduce"]
    assert sync["unexpected"] == 0
    # FLOPs: the matmuls alone are 2 x (a + b) forward, 2 x (a + b) for the weight gradients and 2 x b for the
    # hidden activations' gradient (none for the input image), a = in x hidden, b = hidden x out, per example;
    # XLA also counts elementwise work (activations, softmax, adam), and stays within the usual 6 x params estimate
    a, b = IN * HIDDEN, HIDDEN * OUT
    xla = sync["xla_flops_per_device"] * 8
    assert (4 * a + 6 * b) * BATCH <= xla <= 6 * (a + b) * BATCH * 1.05
    # ... counting a while body once: dropout's random bits come from threefry, a while loop of 5 rounds of integer
    # work, which the step's FLOPs count 5 times (jaxpar.cost.hlo.loop_flops)
    assert sync["flops"] > xla and "trip count" in sync["flops_note"]
    assert sync["memory"]["total"] <= report["device_memory"]


def test_explain_on_data_fsdp_model_matches_the_zero3_theory():
    report = jaxpar.explain(mlp_trainer("data=2,fsdp=2,model=2"), batch_for("mlp", BATCH))
    plan = by_name(report)
    assert plan["hidden.kernel.value"]["spec"] == "(fsdp, model)"
    assert plan["hidden.kernel.value"]["bytes_per_device"] == IN * HIDDEN * 4 // 4
    sizes = {"data": 2, "fsdp": 2, "model": 2, "None": 1}
    for p in plan.values():  # each parameter's bytes / the sizes of the axes its spec names
        ways = np.prod([sizes[a] for a in p["spec"].strip("()").replace("+", ", ").split(", ")])
        assert p["bytes_per_device"] == p["bytes"] // ways, p
    fsdp_params = [p for p in report["plan"]["parameters"] if "fsdp" in p["spec"]]
    p_f = sum(2 * p["bytes_per_device"] for p in fsdp_params)  # what one fsdp group gathers
    sync = report["variants"]["sync"]
    [fsdp] = [t for t in sync["theory"] if t["axis"] == "fsdp"]
    assert fsdp["bytes_sent_per_device"] == 3 * (2 - 1) / 2 * p_f and f"P_f = {p_f:,}" in fsdp["what"]
    gathers = comm(sync, "fsdp", "all-gather")
    assert gathers and all(c["unexpected"] == 0 for c in sync["communication"])
    # parameters are gathered over fsdp at least once: the all-gathers' results hold every fsdp-sharded parameter
    assert sum(c["bytes"] for c in gathers) >= p_f // 2 * 2 - 8


@pytest.mark.slow
def test_local_sgd_explains_a_local_step_without_an_exchange_and_a_meeting_with_one():
    trainer = mlp_trainer("4x2", jaxpar.LocalSGD(period=4), hardware="flops=1e12,alpha=1e-5,bandwidth=1e9")
    report = jaxpar.explain(trainer, batch_for("mlp", BATCH))
    local, meet = report["variants"]["local"], report["variants"]["meet"]
    assert (local["share"], meet["share"]) == (0.75, 0.25)
    per_device = report["plan"]["per_device"]["parameters"]["total"]
    # the local step sends nothing over data (its metrics stay per replica, each replica checks itself)
    assert not [c for c in local["communication"] if "data" in c["axes"].split("+")]
    assert local["unexpected"] == 0 and "data" not in local["busiest_sent"]
    assert sum(c["bytes"] for c in comm(meet, "data")) >= per_device
    [theory] = [t for t in meet["theory"] if t["axis"] == "data"]
    assert theory["per_step_over_period"] == theory["bytes_sent_per_device"] / 4
    assert not [t for t in local["theory"] if t["axis"] == "data"]
    # projections: each variant = compute + its collectives; the run = (3 local + 1 meet) / 4
    for v in (local, meet):
        p = v["projected_seconds"]
        assert p["step"] == p["compute"] + p["communication"]
        assert p["compute"] == v["flops_per_device"] / 1e12
    projection = report["projection"]
    assert np.isclose(projection["local_sgd"]["seconds"],
                      (3 * local["projected_seconds"]["step"] + meet["projected_seconds"]["step"]) / 4)
    assert projection["sync"]["seconds"] == meet["projected_seconds"]["step"]
    assert projection["local_sgd"]["seconds"] < projection["sync"]["seconds"]
    text = jaxpar.format_explain(report)
    assert "PROJECTED mean step time per strategy" in text and "not a measurement" in text


def test_unexplained_collectives_are_flagged():
    trainer = mlp_trainer("4x2", jaxpar.LocalSGD(period=2))
    big = dict(bytes=4096, group=4, axes=("data",))
    assert not expected(Collective("all-gather", **big), "meet", trainer)  # a resharding over data
    assert not expected(Collective("all-reduce", **big), "local", trainer)  # a local step must not exchange
    assert expected(Collective("all-reduce", **big), "meet", trainer)
    assert expected(Collective("all-reduce", 4, 4, ("data",)), "meet", trainer)  # a scalar metric mean
    assert not expected(Collective("all-reduce", 4, 4, ("data",)), "local", trainer)  # local: not even that
    assert not expected(Collective("all-to-all", 4096, 2, ("model",)), "meet", trainer)


@pytest.mark.slow
def test_cli_explain_prints_the_plan_and_trains_nothing(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    code = run.main(["--model", "mlp", "--mesh", "2x4", "--explain", "--hardware", "a100-ib100",
                     "--metrics", str(metrics)])
    out = capsys.readouterr().out
    assert code == 0
    assert "sharding plan (per device):" in out and "hidden.kernel.value" in out and "step variant 'sync'" in out
    assert "PROJECTED on a100-ib100" in out and "0 collective(s) not explained by theory" in out
    assert "done:" not in out and "step 1/" not in out
    assert not metrics.exists()  # nothing trained, nothing half-written


@pytest.mark.slow
def test_cli_hardware_prices_sim_time_and_sets_the_utilisation_peak(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert run.main(["--model", "mlp", "--mesh", "4x2", "--strategy", "local_sgd", "--sync-period", "2", "--steps",
                     "4", "--log-every", "1", "--eval-batches", "0", "--hardware",
                     "flops=1e9,alpha=1e-4,bandwidth=1e8", "--metrics", str(metrics)]) == 0
    out = capsys.readouterr().out
    assert "sim_time is priced on flops=1e9" in out
    records = [json.loads(line) for line in metrics.read_text().splitlines()][1:]
    times = [r["sim_time"] for r in records if "sim_time" in r]
    assert len(times) == 4 and all(b > a for a, b in zip(times, times[1:]))
    local, meet = times[0], times[1] - times[0]
    assert meet > local > 0 and np.isclose(times[2] - times[1], local)  # meetings pay their exchange, local steps not
    for r in records:
        if "flops_utilization" in r:
            assert np.isclose(r["flops_utilization"], r["flops_per_sec"] / (1e9 * 8))


def test_cli_bad_hardware_is_one_line(capsys):
    for value, words in (("h100-magic", "unknown profile 'h100-magic'"), ("flops=abc", "cannot read 'flops=abc'"),
                         ("flops=1e12,alpha=1e-5", "has no bandwidth"), ("alpha=1e-5,bandwidth=1e9", "no flops="),
                         ("a100-nvlink,data.bandwidth=-1", "must be a finite number > 0"),
                         ("a100-nvlink,pipe.alpha=1", "unknown key 'pipe.alpha'")):
        assert run.main(["--model", "mlp", "--hardware", value]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"run.py: error: --hardware '{value}':") and words in err and "\n" not in err
