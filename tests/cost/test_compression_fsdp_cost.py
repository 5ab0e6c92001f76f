"""The compressed fsdp leg (jaxpar.parallel.fsdp_reduce) in `--explain`'s theory and the cost model
(`jaxpar.cost.codecs.fsdp_leg`): the gradient's third of ZeRO-3's fsdp traffic at the codec's bytes, against the
compiled HLO; its seconds on the fsdp link (a kind's own link where the profile has one) and its compute; a slow fsdp
link makes int8 win on data=2,fsdp=4 where a fast link makes it lose (the plan advisor and sim_time)."""

from dataclasses import replace

import optax
import pytest

import jaxpar
from jaxpar.advisor import advise
from jaxpar.cost import codecs
from jaxpar.cost.explain import format_explain
from jaxpar.cost.hardware import Link, parse_hardware
from jaxpar.cost.strategy_costs import variant_shares
from jaxpar.parallel.mesh import FSDP_AXIS
from tests.helpers import batch_for, trainer_for
from tests.parallel.test_compression_fsdp import fsdp_gradient_bytes
from tests.advisor.test_advisor import BATCH, Wide, loss

SLOW_FSDP = "flops=1e12,alpha=1e-6,bandwidth=1e12,fsdp.alpha=1e-6,fsdp.bandwidth=1e5"  # 100 KB/s inside a replica
FAST_FSDP = "flops=1e8,alpha=1e-6,bandwidth=1e12"  # free bytes, slow devices: the codec's compute shows


def _fsdp_theory(trainer):
    report = jaxpar.explain(trainer, batch_for("mlp", 16))
    line = [t for t in report["variants"]["sync"]["theory"] if t["axis"] == FSDP_AXIS]
    assert len(line) == 1
    return line[0], format_explain(report)


@pytest.mark.parametrize("mesh", ["data=2,fsdp=2,model=2", "data=2,fsdp=4"])
@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_explains_fsdp_theory_carries_the_codecs_leg_within_5_percent_of_the_hlo(mesh, codec):
    trainer = trainer_for("mlp", mesh, strategy=jaxpar.Sync("psum", compress=codec))
    trainer.init(0)
    line, text = _fsdp_theory(trainer)
    leg = line["fsdp_leg"]
    measured = fsdp_gradient_bytes(trainer)  # the leg's collectives in the compiled step, written by jaxpar
    assert abs(leg["bytes_sent_per_device"] - measured) <= 0.05 * measured, (leg, measured)
    f = trainer.mesh.shape[FSDP_AXIS]
    plain, _ = _fsdp_theory(trainer_for("mlp", mesh, strategy=jaxpar.Sync("psum")))
    pf_third = plain["bytes_sent_per_device"] / 3  # uncompressed: 3 x (F-1)/F x P_f
    assert line["bytes_sent_per_device"] == pytest.approx(2 * pf_third + leg["bytes_sent_per_device"])
    assert line["steps"] == 2 * (f - 1) + leg["steps"] and leg["kind"] == "all-to-all"
    ratio = leg["bytes_sent_per_device"] / leg["float32_bytes"]
    assert ratio == pytest.approx(0.5) if codec == "bf16" else 0.25 < ratio < 0.6
    assert f"gradient leg compressed by {codec}: an all-to-all of" in text
    assert f"codec {codec} compute on the fsdp leg: {leg['flops']:,} FLOPs" in text
    assert leg["flops"] == {"bf16": 3, "int8": 10}[codec] * leg["elements"] > 0


def test_no_leg_where_the_codec_does_not_compress_the_fsdp_reduction():
    # local SGD's codec is for its meetings; its steps keep the fsdp pmean
    trainer = trainer_for("mlp", "data=2,fsdp=4", strategy=jaxpar.LocalSGD(period=2, compress="int8"))
    for variant in variant_shares(trainer.strategy):
        assert codecs.fsdp_leg(trainer, variant, batch_for("mlp", 16)) is None, variant
    # rows that do not split over fsdp: 2 per replica over fsdp=4 (the partitioner's reduction, uncompressed)
    trainer = trainer_for("mlp", "data=2,fsdp=4", strategy=jaxpar.Sync("psum", compress="int8"))
    assert codecs.fsdp_leg(trainer, "sync", batch_for("mlp", 4)) is None
    assert codecs.fsdp_leg(trainer, "sync", batch_for("mlp", 16)) is not None


def test_the_leg_is_priced_on_the_fsdp_link_and_its_kinds_own_link():
    trainer = trainer_for("mlp", "data=2,fsdp=4", strategy=jaxpar.Sync("psum", compress="int8"))
    leg = codecs.fsdp_leg(trainer, "sync", batch_for("mlp", 16))
    profile = parse_hardware(SLOW_FSDP)
    assert codecs.fsdp_leg_seconds(leg, profile) == pytest.approx(
        leg["steps"] * 1e-6 + leg["bytes_sent_per_device"] / 1e5, rel=1e-12)
    own = replace(profile, kinds={"all-to-all": {FSDP_AXIS: Link(3e-6, 2e5)}})
    assert codecs.fsdp_leg_seconds(leg, own) == pytest.approx(
        leg["steps"] * 3e-6 + leg["bytes_sent_per_device"] / 2e5, rel=1e-12)


def _advised(hardware) -> dict:
    ratios = {"sync compress=int8": 1.0}
    out = advise(Wide, loss, optax.sgd(0.1), BATCH, hardware, 8, meshes=["data=2,fsdp=4,model=1"],
                       remats=("none",), periods=(), codecs=("int8",), steps_ratio=ratios)
    return {c.strategy: c for c in out["plans"]}


def test_a_slow_fsdp_link_makes_int8_on_data2_fsdp4_win_and_a_fast_one_makes_it_lose():
    slow = _advised(SLOW_FSDP)
    plain, int8 = slow["sync allreduce=ring"], slow["sync allreduce=ring compress=int8"]
    assert int8.seconds < 0.6 * plain.seconds, (int8.seconds, plain.seconds)
    fast = _advised(FAST_FSDP)
    plain, int8 = fast["sync allreduce=ring"], fast["sync allreduce=ring compress=int8"]
    assert int8.seconds > plain.seconds and int8.parts["compute"] > plain.parts["compute"], (int8, plain)


def _sim_time(codec, hardware):
    strategy = jaxpar.Sync("psum", compress=codec) if codec else jaxpar.Sync("psum")
    trainer = trainer_for("mlp", "data=2,fsdp=4", strategy=strategy, hardware=hardware)
    state, _ = trainer.step(trainer.init(0), batch_for("mlp", 16))
    return trainer.pricer.cost("sync")


def test_sim_time_of_the_compiled_leg_agrees_in_direction():
    slow = {c: _sim_time(c, SLOW_FSDP) for c in (None, "int8")}
    assert slow["int8"].comm < slow[None].comm, slow
    fast = {c: _sim_time(c, FAST_FSDP) for c in (None, "int8")}
    assert fast["int8"].compute > fast[None].compute, fast
