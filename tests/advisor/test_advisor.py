"""The plan advisor (`jaxpar.advisor`, `jaxpar.plan`, `run.py --plan`): where the best plan is obvious it comes
first, a plan that does not fit a device ranks after every one that does, each plan's flags run it, and bad flags
are one line."""

import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
import models
import run
import jaxpar.advisor as advisor
from tests.helpers import TINY


class Wide(nnx.Module):
    """A user's model (no annotations, so no steps-to-target ratio is known for its local SGD)."""

    def __init__(self, rngs):
        self.up = nnx.Linear(64, 256, rngs=rngs)
        self.down = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean(), {}


BATCH = {"x": jax.ShapeDtypeStruct((32, 64), np.float32), "y": jax.ShapeDtypeStruct((32,), np.int32)}
MESHES = ["data=4,fsdp=1,model=1", "data=1,fsdp=4,model=1", "data=2,fsdp=2,model=1"]


def test_factorizations_are_every_ordered_product():
    assert sorted(advisor.factorizations(4, 3)) == sorted([(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1),
                                                           (4, 1, 1)])
    assert advisor.mesh_specs(2) == ["data=2,fsdp=1,model=1", "data=1,fsdp=2,model=1", "data=1,fsdp=1,model=2"]


def test_long_sequences_add_seq_meshes():
    from jaxpar.advisor.candidates import LONG_SEQUENCE, long_sequence

    assert advisor.mesh_specs(2, seq=True) == ["data=2,fsdp=1,seq=1,model=1", "data=1,fsdp=2,seq=1,model=1",
                                               "data=1,fsdp=1,seq=2,model=1", "data=1,fsdp=1,seq=1,model=2"]
    assert len(advisor.mesh_specs(8, seq=True)) == 20 and len(advisor.mesh_specs(8)) == 10
    assert long_sequence({"tokens": jax.ShapeDtypeStruct((4, LONG_SEQUENCE + 1), np.int32)})
    assert not long_sequence({"tokens": np.zeros((4, 129), np.int32)}) and not long_sequence(BATCH)


@pytest.mark.slow
def test_a_slow_data_link_sends_the_plan_to_fsdp_and_a_slow_fsdp_link_to_data():
    slow_data = "flops=1e12,alpha=1e-6,bandwidth=1e12,data.alpha=1e-3,data.bandwidth=1e6"
    result = advisor.advise(Wide, loss, optax.sgd(0.1), BATCH, slow_data, 4, meshes=MESHES, remats=("none",))
    best = result["plans"][0]
    assert best.mesh == "data=1,fsdp=4,model=1" and best.why == "best"
    # the user's model has no measured steps ratio: periodic strategies rank after every sync plan
    first_unknown = next(i for i, c in enumerate(result["plans"]) if c.steps_ratio is None)
    assert all(c.steps_ratio == 1.0 for c in result["plans"][:first_unknown])
    assert "steps to target not known" in result["plans"][first_unknown].why

    slow_fsdp = "flops=1e12,alpha=1e-6,bandwidth=1e12,fsdp.alpha=1e-3,fsdp.bandwidth=1e6"
    result = advisor.advise(Wide, loss, optax.sgd(0.1), BATCH, slow_fsdp, 4, meshes=MESHES, remats=("none",))
    assert result["plans"][0].mesh == "data=4,fsdp=1,model=1"
    assert result["plans"][0].flags.startswith("--mesh data=4,fsdp=1,model=1 --strategy ")


@pytest.mark.slow
def test_a_plan_that_does_not_fit_ranks_after_every_plan_that_does():
    roomy = advisor.advise(Wide, loss, optax.adam(1e-3), BATCH, "a100-nvlink", 4, meshes=MESHES, remats=("none",))
    sync = {c.mesh: c.memory for c in roomy["plans"] if c.strategy == "sync"}
    replicated, sharded = sync["data=4,fsdp=1,model=1"], sync["data=1,fsdp=4,model=1"]
    assert sharded < replicated  # ZeRO-3 splits parameters and optimizer state
    budget = (replicated + sharded) // 2
    tight = advisor.advise(Wide, loss, optax.adam(1e-3), BATCH, f"a100-nvlink,memory={budget}", 4, meshes=MESHES,
                         remats=("none",))
    fits = [c.fits for c in tight["plans"]]
    assert fits[0] and fits == sorted(fits, reverse=True)  # every fitting plan first
    assert all(c.memory <= budget for c in tight["plans"] if c.fits)
    dp = [c for c in tight["plans"] if c.mesh == "data=4,fsdp=1,model=1" and c.strategy == "sync"][0]
    assert not dp.fits and dp.why == "does not fit a device's memory"


@pytest.mark.slow
def test_a_mesh_the_model_does_not_divide_over_is_refused_with_its_reason():
    config = TINY["transformer"].replace(heads=2)
    batch = {"tokens": jax.ShapeDtypeStruct((8, config.seq_len + 1), np.int32)}
    result = advisor.advise(models.factory(config), models.LOSSES["transformer"], optax.sgd(0.1), batch,
                          "a100-nvlink", 4, meshes=["data=4,fsdp=1,model=1", "data=1,fsdp=1,model=4"],
                          remats=("none",))
    assert {c.mesh for c in result["plans"]} == {"data=4,fsdp=1,model=1"}
    assert "not divisible by mesh axis 'model' of size 4" in result["refused"]["data=1,fsdp=1,model=4"]


@pytest.mark.slow
def test_cli_plan_prints_the_flags_of_the_best_plans_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run.main(["--model", "mlp", "--plan", "--hardware", "a100-eth10", "--devices", "4"]) == 0
    out = capsys.readouterr().out
    assert "jaxpar plan:" in out and "on 4 devices of a100-eth10" in out
    assert "  1. " in out and "python run.py --mesh data=" in out
    assert "x1.71 steps" in out or "x1.59 steps" in out  # the built-in MLP's measured local SGD ratios
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv, needle", [
    (["--plan"], "--plan: needs --hardware"),
    (["--devices", "4", "--hardware", "a100-nvlink"], "--devices 4: applies only with --plan"),
    (["--plan", "--explain", "--hardware", "a100-nvlink"], "--plan with --explain: give one of them"),
    (["--plan", "--hardware", "a100-nvlink", "--devices", "0"], "--devices 0"),
    (["--plan", "--hardware", "a100-nvlink", "--devices", "100000"],
     "--devices 100000: the advisor would start 100,000 devices and compile every mesh of them on this machine; plan "
     "for at most 1,024 devices"),
    (["--plan", "--hardware", "a100-nvlink", "--mesh", "2048"], "--mesh '2048': the advisor would start 2,048 devices"),
])
def test_bad_plan_flags_are_one_line(argv, needle, capsys):
    assert run.main(["--model", "mlp", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_a_slow_permute_link_ranks_the_hand_written_allreduces_after_the_compilers():
    """The hand-written allreduces are made of collective-permutes: priced on the permute's own link (a calibrated
    profile's `kinds`), they lose to the compiler's all-reduce when permutes are slow, and win when they are fast."""
    from jaxpar.cost.profile import Link, Profile

    def plans(permute_alpha):
        links = {axis: Link(1e-5, 1e9) for axis in ("data", "stage", "fsdp", "model")}
        profile = Profile("cpu-like", 1e12, links, kinds={"collective-permute": {
            axis: Link(permute_alpha, 1e9) for axis in links}}, launch=1e-3)
        result = advisor.advise(Wide, loss, optax.sgd(0.1), BATCH, profile, 4, meshes=["data=4,fsdp=1,model=1"],
                              remats=("none",), periods=())
        return {c.strategy: c.seconds for c in result["plans"]}

    slow = plans(1e-3)
    assert all(slow["sync"] < slow[f"sync allreduce={a}"] for a in ("ring", "torus2d", "ps"))
    assert slow["sync"] > 1e-3  # every plan pays the fixed cost per step (launch)
    # ring: 2(N-1) = 6 permutes of the permute link's latency
    assert slow["sync allreduce=ring"] - plans(0.0)["sync allreduce=ring"] > 6 * 1e-3 * 0.999
    fast = plans(0.0)
    assert fast["sync allreduce=torus2d"] < fast["sync"]


def test_with_overlap_sync_is_priced_as_explain_prices_it_and_a_meeting_hides_nothing():
    """`overlap=1`: the advisor's sync plan is explain's step (compute + communication - overlap); local SGD's
    meeting averages parameters after the step, so explain projects it as the sync step without its overlap."""
    hardware = "flops=1e9,alpha=1e-5,bandwidth=1e8,overlap=1,bucket=1000"
    mesh = "data=4,fsdp=1,model=1"
    trainer = jaxpar.Trainer(Wide, loss, optax.sgd(0.1), jaxpar.make_mesh(mesh), hardware=hardware)
    report = jaxpar.explain(trainer, BATCH)
    p = report["variants"]["sync"]["projected_seconds"]
    assert p["overlap"] > 0
    result = advisor.advise(Wide, loss, optax.sgd(0.1), BATCH, hardware, 4, meshes=[mesh], remats=("none",),
                          periods=(4,))
    sync = next(c for c in result["plans"] if c.strategy == "sync")
    assert sync.seconds == pytest.approx(p["step"])
    over_data = sum(c["seconds"] for c in report["variants"]["sync"]["communication"] if "data" in c["axes"])
    local = p["step"] - over_data + p["overlap"]
    meeting = p["step"] + p["overlap"]
    assert report["projection"]["local_sgd"]["seconds"] == pytest.approx((3 * local + meeting) / 4)


@pytest.mark.slow
def test_compiling_the_meshes_at_once_gives_the_same_plans_as_one_at_a_time():
    one = advisor.advise(Wide, loss, optax.sgd(0.1), BATCH, "a100-eth10", 4, meshes=MESHES, workers=1)
    two = advisor.advise(Wide, loss, optax.sgd(0.1), BATCH, "a100-eth10", 4, meshes=MESHES, workers=2)
    assert [(c.flags, c.seconds, c.memory) for c in one["plans"]] == [(c.flags, c.seconds, c.memory)
                                                                       for c in two["plans"]]
    assert one["remat_mesh"] == two["remat_mesh"] and len(one["plans"]) > len(MESHES)


@pytest.mark.slow
def test_cli_plan_notes_a_profile_calibrated_on_another_model(tmp_path, capsys, monkeypatch):
    from jaxpar.cost.builtin_profiles import PROFILES
    from jaxpar.cost.profile_json import save_profile

    path = tmp_path / "transformer.json"
    save_profile(PROFILES["a100-eth10"].__class__(**{**PROFILES["a100-eth10"].__dict__, "model": "transformer"}),
                 path)
    monkeypatch.chdir(tmp_path)
    assert run.main(["--model", "mlp", "--plan", "--hardware", str(path), "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert ("as measured on transformer's training step, not mlp's; for mlp, calibrate with python -m "
            "jaxpar.calibrate --model mlp") in out
    assert "  1. " in out
