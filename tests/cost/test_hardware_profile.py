"""The richer hardware profile: sustained FLOP/s, nodes (hierarchical, ring and node-aligned torus all-reduces with
NIC sharing), overlap of the gradient all-reduce with the backward pass, the wire dtype, the JSON round trip and
`--hardware FILE.json`, and the published results. Expected numbers are worked out by hand in each test."""

import json
import math

import jax
import pytest

import jaxpar
import run
from benchmarks import published
from jaxpar.cost.hardware import (PROFILES, Link, Profile, StepCost, collective_seconds, load_profile, parse_hardware,
                                  save_profile, step_cost)
from jaxpar.cost.hlo import Collective, collective_ops
from jaxpar.cost.pricing import hierarchical_allreduce_seconds, shared
from jaxpar.errors import OptionError
from tests.helpers import batch_for, trainer_for
from tests.cost.test_costmodel import updates

AXES = ("data", "stage", "fsdp", "model")
INTRA, INTER = Link(1e-6, 100e9), Link(10e-6, 10e9)


def nodes(allreduce="ring", nics=1, **kw) -> Profile:
    """2 nodes x 4 devices: 100 GB/s inside a node, 10 GB/s per NIC between nodes."""
    return Profile("two-nodes", 1e12, {a: INTRA for a in AXES}, devices_per_node=4, inter_node=INTER,
                   nics_per_node=nics, allreduce=allreduce, **kw)


def allreduce(nbytes, groups, axes=("data",)):
    return Collective("all-reduce", nbytes, len(groups[0]), axes, groups=tuple(map(tuple, groups)))


# --- nodes -----------------------------------------------------------------------------------------------------------

def test_hierarchical_allreduce_on_2_nodes_of_4_by_hand():
    op = allreduce(8e6, [range(8)])
    # reduce-scatter + all-gather inside a node: 2 (k-1) steps of R/k = 2 MB at 100 GB/s;
    # all-reduce of the 2 MB shard between the 2 nodes: 2 (n-1) steps of R/(k n) = 1 MB, the NIC shared by 4 devices
    by_hand = 2 * 3 * (1e-6 + 2e6 / 100e9) + 2 * 1 * (10e-6 + 1e6 / (10e9 / 4))
    assert by_hand == pytest.approx(946e-6)
    assert collective_seconds(op, nodes("hierarchical")) == pytest.approx(by_hand, rel=1e-12)
    # 4 NICs: every device has its own
    assert collective_seconds(op, nodes("hierarchical", nics=4)) == pytest.approx(
        2 * 3 * (1e-6 + 2e6 / 100e9) + 2 * (10e-6 + 1e6 / 10e9), rel=1e-12)
    assert hierarchical_allreduce_seconds(8e6, 4, 2, INTRA, shared(INTER, 1, 4)) == pytest.approx(by_hand)


def test_ring_allreduce_over_nodes_runs_at_its_slowest_hop_with_the_nic_shared():
    # one ring of 8 leaves each node once: 14 steps of R/8 = 1 MB, each as slow as the hop between nodes
    one_ring = allreduce(8e6, [range(8)])
    assert collective_seconds(one_ring, nodes()) == pytest.approx(14 * (10e-6 + 1e6 / 10e9), rel=1e-12)
    # data groups of a 2x4 mesh: {0,4}, {1,5}, ...: 4 rings leave each node at once through its one NIC
    four_rings = allreduce(4e6, [(i, i + 4) for i in range(4)])
    assert collective_seconds(four_rings, nodes()) == pytest.approx(2 * (10e-6 + 2e6 / (10e9 / 4)), rel=1e-12)
    assert collective_seconds(four_rings, nodes(nics=4)) == pytest.approx(2 * (10e-6 + 2e6 / 10e9), rel=1e-12)
    # a group inside one node never touches a NIC; without nodes every hop is on the axis's link
    inside = allreduce(4e6, [range(4), range(4, 8)], axes=("model",))
    assert collective_seconds(inside, nodes()) == pytest.approx(6 * (1e-6 + 1e6 / 100e9), rel=1e-12)
    flat = Profile("flat", 1e12, {a: INTRA for a in AXES})
    assert collective_seconds(one_ring, flat) == pytest.approx(14 * (1e-6 + 1e6 / 100e9), rel=1e-12)


def test_a_permute_leaving_a_node_shares_the_nic():
    profile = nodes()
    inside = Collective("collective-permute", 1e6, 2, ("data",), pairs=((0, 1), (4, 5)))
    assert collective_seconds(inside, profile) == pytest.approx(1e-6 + 1e6 / 100e9)
    across = Collective("collective-permute", 1e6, 2, ("data",), pairs=tuple((i, i + 4) for i in range(4)))
    assert collective_seconds(across, profile) == pytest.approx(10e-6 + 1e6 / (10e9 / 4))


def test_torus2d_aligns_with_nodes_and_prices_as_the_hierarchical_allreduce():
    hardware = "flops=1e12,alpha=1e-6,bandwidth=100e9,devices_per_node=4,inter.alpha=1e-5,inter.bandwidth=10e9"
    trainer = trainer_for("mlp", "8", strategy=jaxpar.Sync("torus2d"), hardware=hardware)
    assert trainer.strategy.torus_x == 4  # the 4 replicas of a node, not the squarest grid (2)
    batch = batch_for("mlp", size=16)
    compiled = trainer.compiled_step("sync", batch)
    permutes = [op for op in collective_ops(compiled, trainer.mesh) if op.kind == "collective-permute"]
    assert len(permutes) == 2 * 3 + 2 * 1
    elements = 64 * 32 + 32 + 32 * 10 + 10
    padded = 4 * (elements + -elements % 8)  # 9664 bytes
    seconds = sum(collective_seconds(op, trainer.pricer.profile) for op in permutes)
    # X-rings inside a node (6 permutes of R/4), Y-ring between nodes (2 permutes of R/8, 4 devices per NIC)
    assert seconds == pytest.approx(hierarchical_allreduce_seconds(padded, 4, 2, INTRA, shared(INTER, 1, 4)))
    assert seconds == pytest.approx(6 * (1e-6 + padded / 4 / 100e9) + 2 * (1e-5 + padded / 8 / 2.5e9))
    # an explicit torus_x wins; without nodes the squarest grid stays
    assert trainer_for("mlp", "8", strategy=jaxpar.Sync("torus2d", torus_x=2), hardware=hardware).strategy.torus_x == 2
    assert trainer_for("mlp", "8", strategy=jaxpar.Sync("torus2d"), hardware="a100-ib100").strategy.torus_x is None
    report = jaxpar.explain(trainer, batch)
    line = report["variants"]["sync"]["theory"][0]["what"]
    assert "X = 4, the replicas on one node of" in line and "4 devices per node" in line



def test_a_compressed_torus2d_keeps_its_codec_when_aligned_with_nodes():
    hardware = "flops=1e12,alpha=1e-6,bandwidth=100e9,devices_per_node=4,inter.alpha=1e-5,inter.bandwidth=10e9"
    trainer = trainer_for("mlp", "8", strategy=jaxpar.Sync("torus2d", compress="int8"), hardware=hardware)
    comm = trainer.strategy.communicator
    assert trainer.strategy.torus_x == 4 and comm.torus_x == 4
    assert comm.codec.name == "int8" and not comm.native  # the aligned grid used to drop the codec

# --- sustained FLOP/s, overlap, wire dtype ---------------------------------------------------------------------------

def test_compute_is_priced_at_sustained_flops_and_the_builtin_profiles_state_both():
    for profile in PROFILES.values():
        assert profile.flops == 312e12 and profile.sustained == 163e12 and "Narayanan" in profile.source
    assert step_cost(163e9, [], PROFILES["a100-nvlink"]).compute == pytest.approx(1e-3)
    assert step_cost(1e12, [], parse_hardware("flops=4e12,alpha=0,bandwidth=1e9")).compute == 0.25  # no sustained
    assert step_cost(1e12, [], parse_hardware("flops=4e12,sustained=2e12,alpha=0,bandwidth=1e9")).compute == 0.5


def test_overlap_hides_the_gradient_allreduce_but_its_last_bucket():
    grad = allreduce(8e6, [range(8)])  # 14 x (10 us + 100 us) = 1.54 ms on one ring
    tp = allreduce(1e6, [range(4), range(4, 8)], axes=("model",))  # tensor parallel: never hidden
    g = collective_seconds(grad, nodes())
    t = collective_seconds(tp, nodes())
    off = step_cost(3e9, [grad, tp], nodes())  # 3 ms of compute at 1e12
    assert off == StepCost(pytest.approx(3e-3), pytest.approx(g + t), 0.0)
    on = step_cost(3e9, [grad, tp], nodes(overlap=True, bucket=1e6))
    tail = 14 * (10e-6 + 1e6 / 8 / 10e9)  # the last 1 MB bucket: 14 x (10 us + 12.5 us)
    assert on.overlap == pytest.approx(g - tail)  # backward (2 ms) outlasts the rest of the all-reduce
    assert on.compute + on.exposed == pytest.approx(1e-3 + max(2e-3, g - tail) + tail + t)
    short = step_cost(0.3e9, [grad, tp], nodes(overlap=True, bucket=1e6))  # 0.3 ms: backward 0.2 ms
    assert short.overlap == pytest.approx(0.2e-3)
    assert short.compute + short.exposed == pytest.approx(0.1e-3 + (g - tail) + tail + t)
    # a meeting's parameter average (gradients=False) and a bucket as large as the gradient hide nothing
    assert step_cost(3e9, [grad], nodes(overlap=True), gradients=False).overlap == 0.0
    assert step_cost(3e9, [grad], nodes(overlap=True, bucket=8e6)).overlap == 0.0
    # sim_time pays the exposed communication only
    assert [u.sim_time for u in updates("", 2, 2, cost=lambda v: StepCost(1.0, 0.5, 0.2))] == pytest.approx([1.3, 2.6])


def test_a_16_bit_wire_halves_the_gradient_bytes_only():
    grad = allreduce(8e6, [range(8)])
    half = collective_seconds(allreduce(4e6, [range(8)]), nodes())
    assert collective_seconds(grad, nodes(wire="bfloat16")) == pytest.approx(half)
    assert collective_seconds(grad, parse_hardware("flops=1e12,alpha=1e-6,bandwidth=100e9,wire=float16")) == \
        pytest.approx(14 * (1e-6 + 0.5e6 / 100e9))
    tp = allreduce(1e6, [range(4), range(4, 8)], axes=("model",))
    assert collective_seconds(tp, nodes(wire="bfloat16")) == collective_seconds(tp, nodes())
    scalar = allreduce(4, [range(8)])
    assert collective_seconds(scalar, nodes(wire="bfloat16")) == collective_seconds(scalar, nodes())


def test_explain_shows_the_overlap_term_before_the_equals_sign():
    hardware = "flops=1e9,alpha=1e-5,bandwidth=1e8,overlap=1,bucket=1000"
    trainer = trainer_for("mlp", "8", hardware=hardware)
    report = jaxpar.explain(trainer, batch_for("mlp", size=16))
    p = report["variants"]["sync"]["projected_seconds"]
    cost = trainer.pricer.costs["sync"]
    assert 0 < p["overlap"] == cost.overlap < p["communication"]
    assert p["step"] == pytest.approx(p["compute"] + p["communication"] - p["overlap"])
    text = jaxpar.format_explain(report)
    assert (f"compute {p['compute'] * 1e3:.4g} ms + communication {p['communication'] * 1e3:.4g} ms - overlap "
            f"{p['overlap'] * 1e3:.4g} ms = {p['step'] * 1e3:.4g} ms per step") in text


# --- the profile as JSON ---------------------------------------------------------------------------------------------

def test_a_profile_round_trips_through_json_and_loads_with_overrides(tmp_path):
    profile = nodes("hierarchical", nics=2, overlap=True, bucket=1e6, wire="bfloat16", sustained=5e11, memory=8e9)
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    path = tmp_path / "machine.json"
    save_profile(profile, path)
    assert load_profile(path) == profile
    assert parse_hardware(str(path)) == profile
    for name in PROFILES:
        assert Profile.from_dict(json.loads(json.dumps(PROFILES[name].to_dict()))) == PROFILES[name]
    changed = parse_hardware(f"{path},overlap=0,inter.bandwidth=5e9,nics=4")
    assert (changed.overlap, changed.inter_node, changed.nics_per_node) == (False, Link(10e-6, 5e9), 4)
    assert changed.links == profile.links and changed.allreduce == "hierarchical"


@pytest.mark.parametrize("content, why", [
    (None, "no such file"),
    ("{not json", "cannot read it as JSON"),
    ('{"name": "x", "flops": 1e12}', "no 'links' field"),
    ('{"name": "x", "flops": 1e12, "links": {"data": {"alpha": 0, "bandwidth": 1e9}}, "wire": "int8"}',
     "wire must be one of float32, bfloat16, float16"),
    ('{"name": "x", "flops": 1e12, "links": {"data": {"alpha": 0, "bandwidth": 1e9}}, "devices_per_node": 4}',
     "devices_per_node and inter_node go together"),
    ('{"name": "x", "flops": -1, "links": {"data": {"alpha": 0, "bandwidth": 1e9}}}', "flops must be a finite"),
    ('{"name": "x", "flops": 1e12, "links": {}, "speed": 3}', "unknown field(s) speed"),
    ('[1, 2]', "expected a JSON object, got list"),
    ('{"name": "x", "flops": 1e12, "links": {"rows": {"alpha": 0, "bandwidth": 1e9}}}', "'links' must map mesh axes"),
    ('{"name": "x", "flops": 1e12, "links": {"data": {"alpha": 0}}}', "links.data must be {"),
    ('{"name": "x", "flops": 1e12, "links": {"data": {"alpha": 0, "bandwidth": 1e9}}, "overlap": "yes"}',
     "overlap must be true or false"),
])
def test_a_bad_profile_file_is_one_line_naming_the_flag(tmp_path, capsys, content, why):
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(OptionError, match="hardware=") as error:
        parse_hardware(str(path))
    assert why in str(error.value) and "\n" not in str(error.value)
    assert run.main(["--model", "mlp", "--hardware", str(path), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--hardware '{path}'" in err and why in err and "Traceback" not in err


@pytest.mark.parametrize("spec, why", [
    ("a100-nvlink,allreduce=tree", "allreduce must be one of ring, hierarchical"),
    ("a100-nvlink,overlap=yes", "overlap must be 0"),
    ("a100-nvlink,devices_per_node=2.5", "devices_per_node must be a whole number"),
    ("a100-nvlink,devices_per_node=4", "devices_per_node and inter_node go together"),
    ("a100-nvlink,inter.alpha=1e-5", "needs both inter.alpha= and inter.bandwidth="),
    ("a100-nvlink,nics=0", "the value must be a finite number > 0"),
    ("a100-nvlink,wire=int8", "wire must be one of float32, bfloat16, float16"),
    ("a100-nvlink,bucket=-1", "the value must be a finite number > 0"),
])
def test_bad_node_items_are_refused(spec, why):
    with pytest.raises(OptionError, match="hardware=") as error:
        parse_hardware(spec)
    assert why in str(error.value)


@pytest.mark.parametrize("spec, key, first, second", [
    ("a100-nvlink,alpha=1e-5,alpha=2e-5", "alpha", "alpha=1e-5", "alpha=2e-5"),
    ("flops=1e12,alpha=0,bandwidth=1e9,data.bandwidth=2e9,data.bandwidth=3e9", "data.bandwidth",
     "data.bandwidth=2e9", "data.bandwidth=3e9"),
    ("a100-nvlink,overlap=1,overlap=0", "overlap", "overlap=1", "overlap=0"),
])
def test_a_key_given_twice_is_refused_in_one_line(spec, key, first, second):
    """Which of the two was meant cannot be known; a key given once for every axis and once for one axis is not a
    repeat (`alpha=` then `data.alpha=` overrides data's)."""
    with pytest.raises(OptionError) as error:
        parse_hardware(spec)
    assert error.value.as_flag() == (f"--hardware {spec!r}: key {key!r} given twice ({first!r} and {second!r}); "
                                     f"give each key once")
    assert parse_hardware("a100-nvlink,alpha=1e-5,data.alpha=2e-5").links["data"].alpha == 2e-5


# --- published results ---------------------------------------------------------------------------------------------

def test_published_scaling_efficiencies_are_reproduced_within_10_points_where_the_inputs_exist():
    rows = {(r["paper"][:5], r["model"], r["gpus"]): r for r in published.table()}
    assert published.P100_SUSTAINED == pytest.approx(6 * 3.8e9 * 32 / 0.18)  # 4.05e12 FLOP/s
    for key in [("Goyal", "ResNet-50", "8 -> 256"), ("Serge", "Inception V3", "1 -> 512"),
                ("Serge", "ResNet-101", "1 -> 512"), ("Horov", "Inception V3", "1 -> 128"),
                ("Horov", "ResNet-101", "1 -> 128"), ("Horov", "VGG-16", "1 -> 128")]:
        row = rows[key]
        assert abs(row["projected"] - row["reported"]) <= 0.10, row
        assert row["no_overlap"] < row["projected"]  # overlap is what closes the gap
    assert rows["Goyal", "ResNet-50", "8 -> 256"]["projected"] == pytest.approx(0.983, abs=5e-4)
    assert rows["Serge", "Inception V3", "1 -> 512"]["projected"] == pytest.approx(0.898, abs=5e-4)
    assert rows["Serge", "ResNet-101", "1 -> 512"]["projected"] == pytest.approx(0.934, abs=5e-4)
    assert rows["Horov", "Inception V3", "1 -> 128"]["projected"] == pytest.approx(0.913, abs=5e-4)
    assert rows["Horov", "ResNet-101", "1 -> 128"]["projected"] == pytest.approx(0.943, abs=5e-4)
    # the cited single-P100 throughputs (TensorFlow benchmarks, batch 64) set those rows' compute: 64 / 154 s for VGG-16
    assert rows["Horov", "VGG-16", "1 -> 128"]["compute_s"] == pytest.approx(64 / 154)
    assert rows["Horov", "VGG-16", "1 -> 128"]["projected"] == pytest.approx(0.845, abs=5e-4)
    # VGG-16 at 512 GPUs is not reproduced (82.9% against 68%): network contention beyond one NIC is not modelled
    vgg = rows["Serge", "VGG-16", "1 -> 512"]
    assert not vgg["within_10_points"] and vgg["projected"] == pytest.approx(0.829, abs=5e-4)
    assert "| NO |" in published.markdown(published.table())
    case = [c for c in published.cases() if c.model == "VGG-16" and c.gpus == 512][0]
    assert round(published.images_per_second_to_reach(case, 0.68)) == 201  # what the compute would have to be
    assert round(published.images_per_second_to_reach(case, 0.68, overlap=False)) == 83
    assert published.efficiency(case) == pytest.approx(vgg["projected"])
