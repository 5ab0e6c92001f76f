"""The host-side parameter-server simulation: parsing, BSP / ASP / SSP schedules, their limits."""

import doctest

import numpy as np
import pytest

import jaxpar
from tests.helpers import clock_times
from jaxpar.errors import ConfigError, cli_message
from jaxpar.strategies import simulation, stragglers as stragglers_lib
from jaxpar.strategies.simulation import simulate_ps, simulate_server
from jaxpar.strategies.stragglers import Stragglers, compute_times, parse_stragglers


def times(updates):
    return [u.sim_time for u in updates]


@pytest.mark.parametrize("module", [simulation, stragglers_lib], ids=lambda m: m.__name__)
def test_docstring_example_runs(module):
    assert doctest.testmod(module).failed == 0


# --- parsing ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, expected", [
    (None, Stragglers()),
    ("", Stragglers()),
    ("3:2.0", Stragglers({3: 2.0})),
    ("3:2.0,5:1.5", Stragglers({3: 2.0, 5: 1.5})),
    (" 3 : 2 , jitter = 0.1 , seed = 7 ", Stragglers({3: 2.0}, 0.1, 7)),
    ("jitter=0.3", Stragglers({}, 0.3, 0)),
    ("0:0.5", Stragglers({0: 0.5})),  # faster than the rest is allowed
])
def test_parse_good_specs(spec, expected):
    assert parse_stragglers(spec) == expected


@pytest.mark.parametrize("spec, words", [
    ("3:x", ["'3:x'", "cannot read"]),
    ("3", ["'3'", "REPLICA:SLOWDOWN"]),
    ("x:2", ["'x:2'"]),
    ("3:2.0,", ["'3:2.0,'", "cannot read ''"]),
    ("speed=2", ["'speed=2'"]),
    ("seed=1.5", ["'seed=1.5'"]),
    ("jitter=abc", ["'jitter=abc'"]),
    ("3:0", ["slowdown 0", "> 0"]),
    ("3:-2", ["slowdown -2", "> 0"]),
    ("3:inf", ["slowdown inf", "finite"]),
    ("3:nan", ["slowdown nan"]),
    ("jitter=-0.1", ["jitter -0.1", ">= 0"]),
    ("seed=-1", ["seed -1", ">= 0"]),
    ("3:2.0,3:1.5", ["replica 3 is given twice"]),
    ("-1:2.0", ["replica -1", ">= 0"]),
])
def test_parse_errors_are_one_line_naming_flag_and_value(spec, words):
    with pytest.raises(ConfigError) as info:
        parse_stragglers(spec)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"stragglers={spec!r}:")
    assert cli_message(info.value).startswith(f"--stragglers {spec!r}:")
    for word in words:
        assert word in message


def test_replica_outside_the_data_axis():
    parse_stragglers("3:2.0").check(4)
    with pytest.raises(ConfigError, match=r"^stragglers='4:2.0': replica 4 does not exist; the data axis has size 4, "
                                          r"so use replicas 0\.\.3$"):
        parse_stragglers("4:2.0").check(4)
    with pytest.raises(ConfigError, match="replica 4"):  # simulating checks too
        simulate_ps(parse_stragglers("4:2.0"), 4, 0, 1)


@pytest.mark.parametrize("bound", [-1, 1.5, "2", True])
def test_bad_staleness_bound(bound):
    with pytest.raises(ConfigError) as info:
        simulate_ps(Stragglers(), 4, bound, 3)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"staleness={bound!r}:") and "0 = BSP" in message


def test_bad_sizes():
    for call in (lambda: simulate_ps(Stragglers(), 0, 0, 3), lambda: simulate_ps(Stragglers(), 2, 0, -1),
                 lambda: jaxpar.LocalSGD(period=0)):
        with pytest.raises(ConfigError):
            call()


# --- compute times ---------------------------------------------------------------------------------------------------

def test_compute_times():
    assert compute_times(parse_stragglers("1:2.5"), 3, 2).tolist() == [[1.0, 2.5, 1.0], [1.0, 2.5, 1.0]]
    jittered = parse_stragglers("1:2.0,jitter=0.5,seed=3")
    z = np.random.default_rng(3).standard_normal((4, 3))
    np.testing.assert_array_equal(compute_times(jittered, 3, 4), np.array([1.0, 2.0, 1.0]) * np.exp(0.5 * z))
    # a longer draw extends a shorter one, so a schedule's prefix does not depend on its length
    np.testing.assert_array_equal(compute_times(jittered, 3, 100)[:4], compute_times(jittered, 3, 4))


# --- BSP / ASP / SSP schedules ---------------------------------------------------------------------------------------

def test_bsp_no_stragglers():
    updates = simulate_ps(Stragglers(), 4, 0, 10)
    assert times(updates) == [float(k) for k in range(1, 11)]
    for u in updates:
        assert u.participants.tolist() == [True] * 4 and u.staleness.tolist() == [0] * 4
        assert u.participants.dtype == bool and u.staleness.dtype.kind == "i"


def test_bsp_waits_for_the_slowest():
    updates = simulate_ps(parse_stragglers("3:2.0"), 4, 0, 10)
    assert times(updates) == [2.0 * k for k in range(1, 11)]
    assert all(u.participants.all() and not u.staleness.any() for u in updates)


def test_asp_fast_workers_never_wait():
    updates = simulate_ps(parse_stragglers("3:2.0"), 4, None, 1000)
    participants = np.array([u.participants for u in updates])
    staleness = np.array([u.staleness for u in updates])
    assert participants[:, :3].all() and not staleness[:, :3].any()
    assert abs(participants[:, 3].sum() - 500) <= 1
    assert participants[:, 3].tolist() == [k % 2 == 1 for k in range(1000)]  # it delivers at t = 2, 4, 6, ...
    assert (staleness[participants[:, 3], 3] == 1).all() and not staleness[~participants[:, 3], 3].any()
    assert times(updates) == [float(k + 1) for k in range(1000)]
    assert times(simulate_ps(parse_stragglers("3:2.0"), 4, float("inf"), 1000)) == times(updates)  # inf == None


def test_ssp_1_with_a_3x_slower_worker():
    # t=1: fast workers apply (V=1). t=2: applying would make replica 3's version-0 gradient 2 stale: wait.
    # t=3: replica 3 arrives; one update of all four, replica 3 with staleness 1; everyone restarts on V=2. Repeat.
    s1 = simulate_ps(parse_stragglers("3:3.0"), 4, 1, 100)
    assert times(s1) == [1.0 + 1.5 * k if k % 2 == 0 else 1.5 * (k + 1) for k in range(100)]
    staleness = np.array([u.staleness for u in s1])
    participants = np.array([u.participants for u in s1])
    assert staleness.max() == 1 and (staleness == 1).any()
    assert staleness[:, 3].tolist() == [k % 2 for k in range(100)] and not staleness[:, :3].any()
    assert participants[:, :3].all() and participants[:, 3].tolist() == [k % 2 == 1 for k in range(100)]
    asp = simulate_ps(parse_stragglers("3:3.0"), 4, None, 100)
    assert times(asp) == [float(k + 1) for k in range(100)]  # fast workers idle under SSP, never under ASP
    assert s1[-1].sim_time == 150.0


def test_ssp_0_is_bsp_by_hand():
    # 3 replicas with compute times 1, 2 and 0.5 per step. BSP: every update waits for replica 1 (2 per step), so the
    # k-th update completes at 2k, holds all three gradients, each computed on the version just before it (staleness
    # 0). SSP(1) on the same profile is not BSP: replica 2 applies alone at t = 0.5 (the others' version-0 gradients
    # become 1 stale, within the bound); at t = 1 replicas 0 and 2 would make replica 1's 2 stale, so all wait for t = 2.
    profile = parse_stragglers("1:2.0,2:0.5")
    updates = simulate_ps(profile, 3, 0, 6)
    assert times(updates) == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    assert [u.participants.tolist() for u in updates] == [[True, True, True]] * 6
    assert [u.staleness.tolist() for u in updates] == [[0, 0, 0]] * 6
    ssp1 = simulate_ps(profile, 3, 1, 2)
    assert times(ssp1) == [0.5, 2.0] and ssp1[0].participants.tolist() == [False, False, True]
    assert ssp1[1].participants.tolist() == [True, True, True] and ssp1[1].staleness.tolist() == [1, 1, 0]


def random_profiles(count, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        num_replicas = int(rng.integers(1, 9))
        slowdown = {i: float(rng.uniform(1, 5)) for i in range(num_replicas) if rng.random() < 0.5}
        yield Stragglers(slowdown, float(rng.choice([0.0, 0.3])), int(rng.integers(0, 1000))), num_replicas


def test_ssp_limits_over_random_profiles():
    for stragglers, num_replicas in random_profiles(60):
        bsp = simulate_ps(stragglers, num_replicas, 0, 40)
        # S = 0 is BSP: every update has everyone, time per step = the slowest replica's compute time that step,
        # taken from the compute-time table directly (not from another simulation)
        expected = np.cumsum(compute_times(stragglers, num_replicas, 40).max(axis=1))
        np.testing.assert_allclose(times(bsp), expected, rtol=0, atol=1e-9)
        assert all(u.participants.all() and not u.staleness.any() for u in bsp)
        asp = simulate_ps(stragglers, num_replicas, None, 40)
        # ASP applies at every arrival, so its k-th update is no later than BSP's (replica 0 alone never idles)
        assert all(a <= b + 1e-9 for a, b in zip(times(asp), times(bsp)))
        for bound in (0, 1, 2, 3, 5, None):
            updates = simulate_ps(stragglers, num_replicas, bound, 40)
            assert len(updates) == 40
            staleness = np.array([u.staleness for u in updates])
            participants = np.array([u.participants for u in updates])
            assert bound is None or staleness.max() <= bound
            assert participants.any(axis=1).all() and not staleness[~participants].any()
            assert np.all(np.diff(times(updates)) > 0)  # a restarted worker needs time > 0 before the next arrival
    # Deliberately NOT asserted: that a larger S never gives a later k-th update. Counter-examples exist even
    # without jitter (ASP merges simultaneous arrivals into one update, SSP's waits can spread them over several),
    # and with large jitter SSP can even be slower than BSP (test_larger_bound_can_be_later_per_update).


def test_the_real_servers_projection_by_hand():
    """`simulate_server`: the runtime's server, where no two pushes arrive together and a delivering worker starts
    again a round trip after its update. 4 workers, worker 1 three times as slow, compute 1, round trip 0.5."""
    profile = parse_stragglers("1:3.0")
    # the three fast workers tie at t = 1 and are three updates (the emulation makes them one); they deliver
    # again at 1 + 0.5 + 1 = 2.5, each on the version after its own update (2 stale); the slow one at t = 3
    asp = simulate_server(profile, 4, None, 7, compute=1.0, round_trip=0.5)
    assert times(asp) == [1.0, 1.0, 1.0, 2.5, 2.5, 2.5, 3.0]
    assert [u.participants.tolist().index(True) for u in asp] == [0, 2, 3, 0, 2, 3, 1]
    assert [int(u.staleness.max()) for u in asp] == [0, 1, 2, 2, 2, 2, 6]
    assert times(simulate_ps(profile, 4, None, 2)) == [1.0, 2.0]
    # BSP: every update waits for the slow worker (3) and its round trip (0.5)
    bsp = simulate_server(profile, 4, 0, 3, compute=1.0, round_trip=0.5)
    assert times(bsp) == [3.0, 6.5, 10.0] and all(u.participants.all() for u in bsp)
    # no round trip, unit compute: the runtime's ASP makes 10 updates per 3 units (3 + 1/3 workers' rate), BSP 1
    assert simulate_server(profile, 4, None, 200)[-1].sim_time == pytest.approx(60.0)
    assert simulate_server(profile, 4, 0, 200)[-1].sim_time == 600.0
    for bound in (1, 2, 5):
        assert max(int(u.staleness.max()) for u in simulate_server(profile, 4, bound, 200)) == bound
    # one server process, 0.5 per update: the fast three queue at t = 1 (done 1.5, 2, 2.5); each computes again
    # from its update; worker 1 arrives at t = 3 with worker 2 and goes first (the lower index on a tie)
    busy = simulate_server(profile, 4, None, 6, compute=1.0, service=0.5)
    assert times(busy) == [1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
    assert [u.participants.tolist().index(True) for u in busy] == [0, 2, 3, 0, 1, 2]


def test_larger_bound_can_be_later_per_update():
    """Kept as a documented limit: 'more staleness = faster' holds per gradient on average, not per update."""
    profile = Stragglers({0: 2.0, 1: 1.2761517977175736, 2: 0.5}, 2.0, 632694)
    bsp, ssp = times(simulate_ps(profile, 3, 0, 14)), times(simulate_ps(profile, 3, 1, 14))
    assert ssp[-1] > bsp[-1]  # two heavy draws that overlap under BSP are paid one after the other under SSP(1)


def test_meeting_clocks_hand_computed():
    """The clocks sync SGD and local SGD really run on (`strategy.clock`), against hand-computed times."""
    profile = parse_stragglers("1:2.0")  # rows are [1, 2]
    assert clock_times(jaxpar.Sync(stragglers=profile), 2, 3) == [2.0, 4.0, 6.0]
    # period 2: step 0 no meeting -> mean(1, 2); step 1 meets at max(2, 4); step 2 mean(5, 6); step 3 max(6, 8)
    assert clock_times(jaxpar.LocalSGD(period=2, stragglers=profile), 2, 4) == [1.5, 4.0, 5.5, 8.0]
    jittered = parse_stragglers("jitter=0.5,seed=1")
    c = compute_times(jittered, 2, 4)
    sync = clock_times(jaxpar.Sync(stragglers=jittered), 2, 4)
    np.testing.assert_allclose(sync, np.cumsum(c.max(axis=1)))
    meet = (c[0] + c[1]).max()
    local = clock_times(jaxpar.LocalSGD(period=2, stragglers=jittered), 2, 4)
    np.testing.assert_allclose(local, [c[0].mean(), meet, (meet + c[2]).mean(), meet + (c[2] + c[3]).max()])
    # a meeting waits for the max of sums, never longer than sync SGD's sum of per-step maxes
    assert local[3] <= sync[3]


def test_deterministic_from_seed():
    a = simulate_ps(parse_stragglers("2:1.5,jitter=0.3,seed=7"), 4, 2, 200)
    b = simulate_ps(parse_stragglers("2:1.5,jitter=0.3,seed=7"), 4, 2, 200)
    c = simulate_ps(parse_stragglers("2:1.5,jitter=0.3,seed=8"), 4, 2, 200)
    assert times(a) == times(b)
    assert all((x.participants == y.participants).all() and (x.staleness == y.staleness).all() for x, y in zip(a, b))
    assert times(a) != times(c)
    # a shorter run is a prefix of a longer one
    assert times(simulate_ps(parse_stragglers("2:1.5,jitter=0.3,seed=7"), 4, 2, 50)) == times(a)[:50]


CLOCKED = {"sync": lambda **kw: jaxpar.Sync(**kw), "ring": lambda **kw: jaxpar.Sync("ring", **kw),
           "local-4": lambda **kw: jaxpar.LocalSGD(period=4, **kw),
           "post-local-3-after-5": lambda **kw: jaxpar.LocalSGD(period=3, local_after=5, **kw),
           "diloco-2": lambda **kw: jaxpar.DiLoCo(period=2, **kw)}


@pytest.mark.parametrize("name", list(CLOCKED))
@pytest.mark.parametrize("replicas", [1, 2, 8])
def test_a_clock_without_stragglers_counts_steps_as_the_simulator_does(name, replicas, monkeypatch):
    """The clock's shortcut for unit cost and no straggler (sim_time = step number + 1, no simulation per step) is
    the simulator's own answer; a straggler still goes through the simulator."""
    for stragglers in (None, "0:2.0"):
        clock = CLOCKED[name](stragglers=stragglers).clock
        stream = simulation.simulate(clock.stragglers, replicas, clock.bound, clock.rounds)
        expected = [next(stream).sim_time for _ in range(40)]
        assert [clock.time_after(replicas, n) for n in range(40)] == expected
        if stragglers is None:
            assert expected == [float(n + 1) for n in range(40)]
            fresh = CLOCKED[name]().clock  # the shortcut runs no simulation (the host's cost per trainer.step)
            monkeypatch.setattr("jaxpar.strategies.clock.simulate", lambda *a, **k: pytest.fail("simulated"))
            assert [fresh.time_after(replicas, n) for n in range(40)] == expected
            monkeypatch.undo()
        else:  # replica 0 at half speed: the clock runs slower than the step count
            assert expected[-1] > 40.0
