"""The cost model: hardware profiles, alpha-beta prices of collectives, the event simulator priced per step variant,
and a Trainer's sim_time with and without a profile. Expected numbers are worked out by hand in each test."""

import itertools
import math

import jax
import numpy as np
import pytest

import jaxpar
from jaxpar.strategies.clock import Clock, meeting_rounds
from jaxpar.cost.hardware import PROFILES, Link, StepCost, collective_seconds, parse_hardware, step_cost
from jaxpar.cost.hlo import Collective, collective_ops, loop_flops
from jaxpar.runtime.resources import step_flops
from jaxpar.strategies.simulation import simulate
from jaxpar.strategies.stragglers import parse_stragglers
from tests.helpers import batch_for, trainer_for

AXES = ("data", "stage", "fsdp", "seq", "model")
NVLINK = Link(5e-6, 300e9)


def updates(stragglers, replicas, steps, bound=0, rounds=None, cost=None):
    return list(itertools.islice(simulate(parse_stragglers(stragglers), replicas, bound, rounds, cost), steps))


# --- parse_hardware ------------------------------------------------------------------------------------------------

def test_named_profiles_parse_to_themselves_and_nothing_means_no_profile():
    for name, profile in PROFILES.items():
        assert parse_hardware(name) == profile
        assert parse_hardware(f"  {name} ") == profile
        assert parse_hardware(profile) is profile
    assert parse_hardware(None) is None
    assert parse_hardware("") is None
    assert PROFILES["a100-ib100"].links["data"] == Link(10e-6, 12.5e9)
    assert PROFILES["a100-eth10"].links["data"] == Link(50e-6, 1.25e9)
    assert PROFILES["a100-eth10"].links["model"] == NVLINK
    # every profile prices every mesh axis; the stage axis crosses nodes on the data axis's link
    assert all(tuple(profile.links) == AXES for profile in PROFILES.values())
    assert PROFILES["a100-ib100"].links["stage"] == Link(10e-6, 12.5e9)
    assert PROFILES["a100-eth10"].links["stage"] == Link(50e-6, 1.25e9)
    assert PROFILES["a100-nvlink"].links["stage"] == NVLINK


def test_custom_profile_gives_its_numbers_to_every_axis():
    profile = parse_hardware("flops=100e12,alpha=1e-5,bandwidth=12.5e9")
    assert profile.flops == 100e12
    assert {axis: profile.links[axis] for axis in AXES} == {axis: Link(1e-5, 12.5e9) for axis in AXES}
    assert profile.name == "flops=100e12,alpha=1e-5,bandwidth=12.5e9"
    # per-axis items beat the all-axes ones, whatever their order
    mixed = parse_hardware("flops=1e12,data.bandwidth=2e9,alpha=0,bandwidth=1e9")
    assert [mixed.links[a] for a in AXES] == [Link(0.0, 2e9), Link(0.0, 1e9), Link(0.0, 1e9), Link(0.0, 1e9), Link(0.0, 1e9)]
    staged = parse_hardware("flops=1e12,alpha=0,bandwidth=1e9,stage.bandwidth=3e9")
    assert [staged.links[a] for a in AXES] == [Link(0.0, 1e9), Link(0.0, 3e9), Link(0.0, 1e9), Link(0.0, 1e9), Link(0.0, 1e9)]


def test_overrides_change_only_the_named_link():
    profile = parse_hardware("a100-nvlink,data.bandwidth=1.25e9,data.alpha=5e-5")
    assert profile.flops == 312e12
    assert profile.links == {"data": Link(5e-5, 1.25e9), "stage": NVLINK, "fsdp": NVLINK, "seq": NVLINK,
                             "model": NVLINK}
    assert profile.source.endswith("overridden: data.bandwidth=1.25e9, data.alpha=5e-5")
    assert PROFILES["a100-nvlink"].links["data"] == NVLINK  # the named profile is left alone
    every = parse_hardware("a100-ib100,alpha=0,flops=1e12")
    assert every.flops == 1e12
    assert every.links == {"data": Link(0.0, 12.5e9), "stage": Link(0.0, 12.5e9), "fsdp": Link(0.0, 300e9),
                           "seq": Link(0.0, 300e9),
                           "model": Link(0.0, 300e9)}


@pytest.mark.parametrize("spec, why", [
    ("tpu-v9", "unknown profile 'tpu-v9'"),
    ("flops", "unknown profile 'flops'"),
    ("a100-nvlink,latency=1e-6", "unknown key 'latency'"),
    ("a100-nvlink,gpu.alpha=1e-6", "unknown key 'gpu.alpha'"),
    ("a100-nvlink,data.flops=1e12", "unknown key 'data.flops'"),
    ("a100-nvlink,data.bandwidth=-1e9", "must be a finite number > 0"),
    ("a100-nvlink,alpha=-1e-6", "must be a finite number > 0"),
    ("a100-nvlink,flops=0", "must be a finite number > 0"),
    ("a100-nvlink,bandwidth=0", "must be a finite number > 0"),
    ("a100-nvlink,flops=inf", "must be a finite number > 0"),
    ("a100-nvlink,flops=nan", "must be a finite number > 0"),
    ("a100-nvlink,data.alpha=fast", "cannot read 'data.alpha=fast'"),
    ("a100-nvlink,flops", "cannot read 'flops'"),
    ("a100-nvlink,", "cannot read ''"),
    ("alpha=1e-5,bandwidth=1e9", "no flops="),
    ("flops=1e12,alpha=1e-5", "the data axis has no bandwidth"),
    ("flops=1e12,bandwidth=1e9", "the data axis has no alpha"),
    ("flops=1e12,alpha=1e-5,data.bandwidth=1e9", "the stage axis has no bandwidth"),
])
def test_bad_hardware_specs_are_refused_in_one_line_naming_the_option(spec, why):
    with pytest.raises(jaxpar.OptionError) as raised:
        parse_hardware(spec)
    message = str(raised.value)
    assert message.startswith(f"hardware={spec!r}: ")
    assert why in message
    assert "\n" not in message
    assert raised.value.as_flag().startswith(f"--hardware {spec!r}: ")
    assert isinstance(raised.value, jaxpar.ConfigError)


def test_a_trainer_refuses_a_bad_profile_and_a_step_without_flops():
    with pytest.raises(jaxpar.OptionError, match=r"^hardware='a100': unknown profile 'a100'"):
        trainer_for("mlp", "4x2", hardware="a100")
    with pytest.raises(jaxpar.OptionError, match=r"^hardware='a100-nvlink': this backend gives no FLOP count"):
        step_cost(None, [], PROFILES["a100-nvlink"])
    assert step_cost(2e12, [], parse_hardware("flops=1e12,alpha=1,bandwidth=1")) == StepCost(2.0, 0.0)


# --- collective_seconds ----------------------------------------------------------------------------------------------

def test_collective_seconds_follow_the_alpha_beta_formulas():
    profile = parse_hardware("flops=1e12,alpha=1e-5,bandwidth=1e9")
    a, beta, r = 1e-5, 1e9, 8000  # R = 8000 bytes per device, groups of 4
    expected = {"all-reduce": 2 * 3 * a + 2 * 3 / 4 * r / beta,  # 6e-5 + 1.2e-5
                "all-gather": 3 * a + 3 / 4 * r / beta,  # 3e-5 + 6e-6
                "reduce-scatter": 3 * a + 3 * r / beta,  # 3e-5 + 2.4e-5
                "all-to-all": 3 * a + 3 / 4 * r / beta,  # 3e-5 + 6e-6
                "collective-permute": a + r / beta}  # 1e-5 + 8e-6
    for kind, seconds in expected.items():
        group = 2 if kind == "collective-permute" else 4
        assert collective_seconds(Collective(kind, r, group, ("data",)), profile) == pytest.approx(seconds, rel=1e-12)
    assert collective_seconds(Collective("all-reduce", r, 4, ("data",)), profile) == pytest.approx(7.2e-5)
    assert collective_seconds(Collective("reduce-scatter", r, 4, ("data",)), profile) == pytest.approx(5.4e-5)
    assert collective_seconds(Collective("collective-permute", r, 2, ("data",)), profile) == pytest.approx(1.8e-5)
    # a group of one device moves nothing
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        assert collective_seconds(Collective(kind, r, 1, ()), profile) == 0.0
    # the same all-reduce over 8 devices: 14 alpha + 14/8 R / beta
    assert collective_seconds(Collective("all-reduce", r, 8, ("data",)), profile) == pytest.approx(14e-5 + 1.4e-5)


def test_a_collective_over_several_axes_runs_at_the_slowest_link():
    profile = PROFILES["a100-ib100"]  # data: 10 us, 12.5 GB/s; model: 5 us, 300 GB/s
    r = 1_000_000
    both = collective_seconds(Collective("all-reduce", r, 8, ("data", "model")), profile)
    assert both == pytest.approx(2 * 7 * 10e-6 + 2 * 7 / 8 * r / 12.5e9)  # 1.4e-4 + 1.4e-4
    assert both == pytest.approx(2.8e-4)
    model = collective_seconds(Collective("all-reduce", r, 8, ("model",)), profile)
    assert model == pytest.approx(2 * 7 * 5e-6 + 2 * 7 / 8 * r / 300e9)
    # slowest alpha and slowest bandwidth may come from different axes
    mixed = parse_hardware("flops=1e12,alpha=1e-6,bandwidth=1e9,data.alpha=1e-4,model.bandwidth=1e8")
    assert mixed.link(("data", "model")) == Link(1e-4, 1e8)
    assert collective_seconds(Collective("all-gather", 4000, 2, ("data", "model")), mixed) == \
        pytest.approx(1e-4 + 0.5 * 4000 / 1e8)
    assert collective_seconds(Collective("all-gather", 4000, 2, ("fsdp",)), mixed) == pytest.approx(1e-6 + 2e-6)
    # axes unknown (no mesh given): the slowest link of the profile
    assert mixed.link(()) == Link(1e-4, 1e8)
    assert collective_seconds(Collective("collective-permute", 4000, 2, None), mixed) == pytest.approx(1e-4 + 4e-5)


# --- simulate, priced by hand-built costs ----------------------------------------------------------------------------

def test_sync_steps_complete_at_the_slowest_compute_plus_the_communication():
    cost = {"sync": StepCost(0.5, 0.25)}.__getitem__  # any other variant would be a KeyError
    sync = lambda update: ("sync",)  # noqa: E731
    plain = updates("", 8, 5, 0, sync, cost)
    assert [u.sim_time for u in plain] == [(k + 1) * (1.0 * 0.5 + 0.25) for k in range(5)]
    assert [u.sim_time for u in plain] == [0.75, 1.5, 2.25, 3.0, 3.75]
    slow = updates("3:2.0", 8, 5, 0, sync, cost)
    assert [u.sim_time for u in slow] == [(k + 1) * (2.0 * 0.5 + 0.25) for k in range(5)]
    assert [u.sim_time for u in slow] == [1.25, 2.5, 3.75, 5.0, 6.25]
    assert all(u.participants.all() and not u.staleness.any() for u in slow)
    three = updates("3:2.0,5:3.0", 8, 3, 0, sync, cost)  # the slowest one sets the pace
    assert [u.sim_time for u in three] == [1.75, 3.5, 5.25]


def test_local_sgd_pays_local_comm_without_a_barrier_and_waits_only_at_the_meeting():
    costs = {"local": StepCost(0.5, 0.125), "meet": StepCost(0.75, 0.25)}
    rounds = meeting_rounds(4)
    # 4 replicas, replica 3 twice as slow. A fast replica's clock after each local step: 0.5 + 0.125 = 0.625 per
    # step; the slow one's: 1.0 + 0.125 = 1.125 per step. Local steps report the mean of the 4 clocks.
    fast = [0.625 * (s + 1) for s in range(3)]  # 0.625, 1.25, 1.875
    slow = [1.125 * (s + 1) for s in range(3)]  # 1.125, 2.25, 3.375
    local = [(3 * f + s) / 4 for f, s in zip(fast, slow)]  # 0.75, 1.5, 2.25
    # the meeting: each replica adds its meet compute (no comm yet), everyone waits for the slowest, then the
    # meeting's own comm: max(1.875 + 0.75, 3.375 + 2 * 0.75) + 0.25
    meet = max(fast[-1] + 0.75, slow[-1] + 2 * 0.75) + 0.25  # 5.125
    # the second round starts for everyone at the meeting
    second = [meet + (3 * f + s) / 4 for f, s in zip(fast, slow)] + [2 * meet]
    expected = local + [meet] + second
    assert expected == [0.75, 1.5, 2.25, 5.125, 5.875, 6.625, 7.375, 10.25]
    steps = updates("3:2.0", 4, 8, 0, rounds, costs.__getitem__)
    assert [u.sim_time for u in steps] == expected
    assert all(u.participants.all() and not u.staleness.any() for u in steps)
    # a barrier at every local step would have charged the slow replica: 1.125 > 0.75 after the first step
    assert steps[0].sim_time < 1.125
    # nobody slow: local steps 0.625 apart, the meeting 3 x 0.625 + 0.75 + 0.25 later than the round began
    plain = updates("", 4, 8, 0, rounds, costs.__getitem__)
    assert [u.sim_time for u in plain] == [0.625, 1.25, 1.875, 2.875, 3.5, 4.125, 4.75, 5.75]


def test_local_sgd_sync_phase_prices_the_sync_variant_first():
    costs = {"sync": StepCost(1.0, 0.5), "local": StepCost(0.5, 0.0), "meet": StepCost(0.5, 0.25)}
    steps = updates("1:2.0", 2, 4, 0, meeting_rounds(2, sync_steps=2), costs.__getitem__)
    # two sync steps at 2 x 1.0 + 0.5; then local (mean of 0.5 and 1.0 after 5.0) and meet (max(1.0, 2.0) + 0.25)
    assert [u.sim_time for u in steps] == [2.5, 5.0, 5.75, 7.25]


@pytest.mark.parametrize("bound", [None, 2], ids=["asp", "ssp2"])
@pytest.mark.parametrize("stragglers", ["1:3.0,3:2.0", "3:2.0,jitter=0.3,seed=1"])
def test_a_price_changes_when_server_updates_complete_never_who_delivers(stragglers, bound):
    compute, comm, count = 0.37, 0.011, 24
    unit = updates(stragglers, 4, count, bound)
    priced = updates(stragglers, 4, count, bound, cost=lambda variant: StepCost(compute, comm))
    assert max(u.staleness.max() for u in unit) >= 1  # stale reads happen
    assert min(u.participants.sum() for u in unit) < 4  # and partial updates
    for u, (a, b) in enumerate(zip(unit, priced)):
        np.testing.assert_array_equal(b.participants, a.participants)
        np.testing.assert_array_equal(b.staleness, a.staleness)
        # the communication stops the world: every earlier update delays everything after it by `comm`
        assert b.sim_time == pytest.approx(compute * a.sim_time + (u + 1) * comm, rel=1e-12)


def test_a_priced_asp_server_by_hand():
    # replica 3 twice as slow, compute 0.5, comm 0.25. Replicas 0-2 deliver at 0.5: update 0 completes at 0.75 and
    # stops replica 3 (due at 1.0) until 1.25; replicas 0-2 restart at 0.75 and deliver at 1.25 with replica 3:
    # update 1 completes at 1.5. Every two updates repeat this, 1.5 later.
    steps = updates("3:2.0", 4, 6, None, cost=lambda variant: StepCost(0.5, 0.25))
    assert [u.sim_time for u in steps] == [0.75, 1.5, 2.25, 3.0, 3.75, 4.5]
    assert [u.participants.tolist() for u in steps[:2]] == [[True, True, True, False], [True, True, True, True]]
    assert steps[1].staleness.tolist() == [0, 0, 0, 1]


# --- ring vs torus2d vs ps, priced from their compiled steps ---------------------------------------------------------

@pytest.mark.slow
def test_ring_torus2d_and_ps_priced_from_their_compiled_permutes():
    hardware = "flops=1e12,alpha=1e-5,bandwidth=1e9"
    alpha, beta, n = 1e-5, 1e9, 8
    batch = batch_for("mlp", size=16)
    ops, trainers = {}, {}
    for name, kw in (("ring", {}), ("torus2d", {"torus_x": 2}), ("ps", {})):
        trainer = trainers[name] = trainer_for("mlp", "8", strategy=jaxpar.Sync(name, **kw), hardware=hardware)
        trainer.step(trainer.init(0), batch)  # prices the step it compiles
        ops[name] = collective_ops(trainer.compiled_step("sync"), trainer.mesh)
    mesh, profile = trainers["ring"].mesh, trainers["ring"].pricer.profile
    assert mesh.devices.shape == (8, 1, 1, 1, 1) and trainers["torus2d"].strategy.torus_x == 2
    params = trainers["ring"].abstract_state().params
    elements = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    assert elements == 64 * 32 + 32 + 32 * 10 + 10  # 2410 float32
    fused = 4 * elements  # B: the fused gradient, 9640 bytes
    padded = 4 * (elements + -elements % n)  # split into N equal chunks: 9664 bytes
    permutes = {name: [op for op in found if op.kind == "collective-permute"] for name, found in ops.items()}
    for found in permutes.values():
        assert all(op.group == 2 and op.axes == ("data",) for op in found)

    ring = permutes["ring"]
    assert len(ring) == 2 * (n - 1) == 14
    assert [op.bytes for op in ring] == [padded // n] * 14  # 1208 bytes each
    assert all(set(op.pairs) == {(i, (i + 1) % n) for i in range(n)} for op in ring)

    x, y = 2, 4
    torus = permutes["torus2d"]
    assert len(torus) == 2 * (x - 1) + 2 * (y - 1) == 8
    assert sorted(op.bytes for op in torus) == [padded // (x * y)] * 6 + [padded // x] * 2  # 6 x 1208, 2 x 4832
    assert sum(op.bytes for op in torus) == sum(op.bytes for op in ring) == 2 * (n - 1) * padded // n  # same bytes

    ps = permutes["ps"]
    assert len(ps) == 2 * (n - 1) == 14
    assert [op.bytes for op in ps] == [fused] * 14  # the whole gradient, to and from the root
    assert sorted(op.pairs for op in ps) == sorted([((s, 0),) for s in range(1, n)] + [((0, r),) for r in range(1, n)])

    seconds = {name: sum(collective_seconds(op, profile) for op in found) for name, found in permutes.items()}
    assert seconds["ring"] == pytest.approx(2 * (n - 1) * (alpha + padded / n / beta))  # 14 x (10 + 1.208) us
    assert seconds["ring"] == pytest.approx(156.912e-6)
    assert seconds["torus2d"] == pytest.approx(2 * (x - 1) * (alpha + padded / x / beta)
                                               + 2 * (y - 1) * (alpha + padded / (x * y) / beta))
    assert seconds["torus2d"] == pytest.approx(96.912e-6)
    assert seconds["ps"] == pytest.approx(2 * (n - 1) * (alpha + fused / beta))  # 14 x (10 + 9.64) us
    assert seconds["ps"] == pytest.approx(274.96e-6)
    assert seconds["ps"] > seconds["ring"] > seconds["torus2d"]
    assert len(torus) * alpha < len(ring) * alpha
    # the step's price is these permutes plus the metrics' scalar all-reduce over the 8 replicas
    for name, trainer in trainers.items():
        rest = [op for op in ops[name] if op.kind != "collective-permute"]
        assert [(op.kind, op.group, op.axes) for op in rest] == [("all-reduce", 8, ("data",))]
        assert trainer.pricer.costs["sync"].comm == pytest.approx(
            seconds[name] + 14 * alpha + 14 / 8 * rest[0].bytes / beta)


# --- a Trainer's sim_time --------------------------------------------------------------------------------------------

def sim_times(trainer, steps):
    seen = []
    trainer.fit(trainer.init(0), (batch_for("mlp", size=16, seed=k) for k in range(steps)), steps=steps,
                on_step=lambda step, metrics: seen.append((step, metrics["sim_time"])))
    assert [step for step, _ in seen] == list(range(1, steps + 1))
    return [t for _, t in seen]


@pytest.mark.parametrize("strategy", [jaxpar.Sync(), jaxpar.LocalSGD(period=4), jaxpar.SSP(staleness=2)],
                         ids=["sync", "local_sgd_H4", "ssp2"])
def test_without_a_profile_sim_time_counts_steps(strategy):
    trainer = trainer_for("mlp", "4x2", strategy=strategy)
    assert trainer.pricer is None  # nothing priced: every step costs 1
    assert sim_times(trainer, 6) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_without_a_profile_a_straggler_sets_the_sync_clock():
    trainer = trainer_for("mlp", "4x2", strategy=jaxpar.Sync(stragglers="3:2.0"))
    assert sim_times(trainer, 6) == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]  # each step waits for replica 3, 2x slower


def test_with_a_profile_sync_sim_time_adds_up_the_compiled_step_cost():
    hardware = "flops=1e9,alpha=1e-5,bandwidth=1e9"
    trainer = trainer_for("mlp", "4x2", hardware=hardware)
    times = sim_times(trainer, 4)
    cost = trainer.pricer.costs["sync"]
    compiled = trainer.compiled_step("sync")
    flops = step_flops(compiled)
    assert flops is not None and flops > 0
    # compute: XLA's FLOPs with every while body (here none) counted its trip count times
    assert cost.compute == pytest.approx(loop_flops(compiled, flops).per_device / 1e9, rel=1e-12)
    ops = collective_ops(compiled, trainer.mesh)
    assert any(op.kind == "all-reduce" and op.axes == ("data",) for op in ops)  # the gradient's all-reduce
    assert cost.comm == pytest.approx(sum(collective_seconds(op, trainer.pricer.profile) for op in ops), rel=1e-12)
    assert cost.comm > 3 * 1e-5  # at least the gradient all-reduce's 2(4-1) alpha / 2
    assert times == pytest.approx([(k + 1) * (cost.compute + cost.comm) for k in range(4)], rel=1e-12)
    assert trainer.trace_counts == {"sync": 1}
    # the per-device FLOPs times the devices is what a step reports as `flops`
    assert list(trainer.step_flops.values()) == [flops * 8]

    slow = trainer_for("mlp", "4x2", hardware=hardware, strategy=jaxpar.Sync(stragglers="3:2.0"))
    assert sim_times(slow, 3) == pytest.approx([(k + 1) * (2 * cost.compute + cost.comm) for k in range(3)],
                                               rel=1e-12)


def test_with_a_profile_local_sgd_prices_the_meeting_before_it_runs():
    trainer = trainer_for("mlp", "4x2", hardware="flops=1e9,alpha=1e-5,bandwidth=1e9",
                          strategy=jaxpar.LocalSGD(period=4))
    state = trainer.init(0)
    state, metrics = trainer.step(state, batch_for("mlp", size=16, seed=0), 0)
    assert set(trainer.pricer.costs) == {"local", "meet"}  # priced ahead: the meeting has not run
    assert trainer.trace_counts == {"local": 1, "meet": 1}
    local, meet = trainer.pricer.costs["local"], trainer.pricer.costs["meet"]
    assert meet.comm > local.comm  # the meeting averages every parameter
    times = [metrics["sim_time"]]
    for k in range(1, 8):
        state, metrics = trainer.step(state, batch_for("mlp", size=16, seed=k), k)
        times.append(metrics["sim_time"])
    assert trainer.trace_counts == {"local": 1, "meet": 1}  # the meeting compiled once, ahead of time
    assert trainer.pricer.costs == {"local": local, "meet": meet}
    one = local.compute + local.comm
    round_time = 3 * one + meet.compute + meet.comm
    expected = [one, 2 * one, 3 * one, round_time, round_time + one, round_time + 2 * one, round_time + 3 * one,
                2 * round_time]
    assert times == pytest.approx(expected, rel=1e-12)


def test_a_priced_clock_prices_each_step_when_it_runs():
    """A new batch shape re-prices its variant: the steps after it pay the new cost, the ones before keep theirs."""
    price = {"sync": StepCost(1.0, 0.0)}
    clock = Clock("", 0, lambda u: ("sync",), cost=lambda v: price[v])
    assert clock.time_after(4, 0) == 1.0
    price["sync"] = StepCost(5.0, 0.0)
    assert [clock.time_after(4, n) for n in range(3)] == [1.0, 6.0, 11.0]


def test_a_priced_server_clock_times_the_schedule_it_replays():
    """SSP / ASP priced: the unit-cost schedule (what the device replays) priced update by update, C x its advance
    + M, however large M is against C (a re-simulation in seconds once grouped arrivals differently)."""
    unit = Clock("1:2.0", None, lambda u: ("update",))
    priced = unit.priced(lambda v: StepCost(1e-9, 1e-4))
    times = [priced.time_after(4, n) for n in range(400)]
    schedule = unit.schedule(4, 400)
    expected = [u.sim_time * 1e-9 + (n + 1) * 1e-4 for n, u in enumerate(schedule)]
    np.testing.assert_allclose(times, expected, rtol=1e-12)
