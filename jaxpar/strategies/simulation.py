"""The event simulation behind every strategy's clock: replicas, a server and the staleness rule.

The mesh runs its devices in lock step, so time is simulated on the host (the semantics:
docs/strategies.md, "Emulated asynchrony (SSP / ASP)"). `simulate` is the one event simulator behind `sim_time`
for every strategy (`jaxpar.strategies.clock`); the straggler profile is `jaxpar.strategies.stragglers`:

- replica i's k-th step costs `c_ik x compute(variant)` seconds, c_ik its straggler factor (with jitter) and
  `compute` the variant's full-speed time (`StepCost`: 1.0 without a price; the cost model's FLOPs / peak with a
  hardware profile);
- replicas deliver into a pending set; the server applies the set as one update unless that would push some
  in-flight gradient's staleness over the bound S (0 = every replica, every update: BSP = sync SGD; None = ASP);
- an update's communication (`StepCost.exposed`: the cost model's alpha-beta price of the collectives its
  compiled step contains; 0 without a price) stops the world: the update completes `comm` later and every replica
  still computing is delayed as much. So who delivers, and how stale, never depends on the profile: only when;
- a round may hold several steps per replica (local SGD: H - 1 local steps, then the meeting); a local step's own
  collectives (scalar metric means) add to that replica's time without a barrier. Between meetings there is no
  common clock, so those steps report the mean of the replicas' clocks.

SSP / ASP replay the resulting schedule on the device: replicas that deliver nothing in an update are masked out,
and each participant reads the parameter version `staleness` updates old. Sync SGD and local SGD / DiLoCo only read
its times.

Pure Python + numpy on purpose: no JAX, so the schedule is cheap, testable alone and identical on every process.

    >>> s = parse_stragglers("3:2.0")
    >>> [u.sim_time for u in simulate_ps(s, num_replicas=4, staleness_bound=None, num_updates=3)]
    [1.0, 2.0, 3.0]
    >>> simulate_ps(s, 4, None, 2)[1].staleness.tolist()   # replica 3 computed on version 0, applied after update 0
    [0, 0, 0, 1]
    >>> [u.sim_time for u in itertools.islice(simulate(s, 4), 3)]   # BSP waits for the slowest replica every step
    [2.0, 4.0, 6.0]
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np

from jaxpar.checks import check_int, int_problem
from jaxpar.errors import ConfigError, OptionError
from jaxpar.strategies.stragglers import Stragglers, parse_stragglers  # noqa: F401  (the doctest's parse_stragglers)

# Arrivals closer than this are the same instant: sums of float compute times may differ in the last bits.
TIME_TOLERANCE = 1e-9
MAX_SIMULATED_UPDATES = 10 ** 6  # ~35 s and ~200 MB of host time and memory on this machine


class StepCost(NamedTuple):
    """Simulated seconds of one step variant: a full-speed replica's compute, its collectives, and the part of them
    hidden under the backward pass (`overlap`); a step takes compute + comm - overlap. The cost model
    (`jaxpar.cost.hardware`) prices a compiled step as one; without a price every step is `UNIT`."""

    compute: float = 1.0
    comm: float = 0.0
    overlap: float = 0.0

    @property
    def exposed(self) -> float:
        """The communication a step waits for: comm - overlap."""
        return self.comm - self.overlap


UNIT = StepCost()  # no price: one unit of compute per step, communication free (sim_time = the step count)


class Update(NamedTuple):
    """One step as the simulation sees it; for a server update: an optimizer step on its participants' mean gradient."""

    participants: np.ndarray  # bool [R]: replicas whose gradient is in this update (every replica for a local step)
    staleness: np.ndarray  # int [R]: updates between the version read and the one applied to; 0 if not participating
    sim_time: float  # the simulated instant the step completes


def _check_staleness(staleness_bound) -> float:
    if staleness_bound is None or staleness_bound == math.inf:
        return math.inf
    problem = int_problem(staleness_bound, 0, why="0 = BSP")
    if problem:
        raise OptionError("staleness", staleness_bound, f"{problem}, or unset for ASP (no bound)")
    return int(staleness_bound)


CHUNK_ROWS = 4096  # rows of compute times drawn at a time


class _Rows:
    """Row k = every replica's straggler factor for its k-th step, drawn lazily CHUNK_ROWS at a time from one seeded
    stream (the same numbers as one `stragglers.compute_times` call); rows every replica has used are dropped."""

    def __init__(self, stragglers: Stragglers, num_replicas: int):
        self._factors = stragglers.factors(num_replicas)
        self._rng = np.random.default_rng(stragglers.seed)
        self._jitter, self._replicas = stragglers.jitter, num_replicas
        self._rows: list = []
        self._first = 0  # step number of self._rows[0]

    def factor(self, step: int, replica: int) -> float:
        while step - self._first >= len(self._rows):
            z = self._rng.standard_normal((CHUNK_ROWS, self._replicas))
            self._rows.extend((self._factors * np.exp(self._jitter * z)).tolist())
        return self._rows[step - self._first][replica]

    def forget_before(self, step: int) -> None:
        drop = step - self._first
        if drop >= CHUNK_ROWS:
            del self._rows[:drop]
            self._first = step


def simulate(stragglers: Stragglers, num_replicas: int, staleness_bound: int | None = 0, rounds=None, cost=None,
             server: tuple[float, float, float] | None = None):
    """Every step of a run, lazily and in order, as `Update`s (see the module docstring).

    `rounds(u)` -> the step variants each replica runs for update u, the last of which carries the update
    (default: one step named "step"); a round of several steps needs staleness_bound 0. `cost(variant)` -> its
    `StepCost` (default: `UNIT`, one unit of compute, free communication). Workers start on version 0 at
    t = 0; after an update, exactly the delivering workers start their next round, on the new version. The bound
    holds for delivered gradients too: each was in flight at every earlier update, so V - read <= S.

    `server` = (compute, round_trip, service): the real parameter server of `jaxpar.runtime.ray` instead of the
    emulation. Each step costs `compute` seconds x the factor; arrivals reach the server one at a time (no two pushes
    of real processes land at the same instant: replicas that tie in the emulation form one update, on the runtime
    each its own); the one server process applies one update at a time, each taking `service` seconds (an arrival
    while it is busy waits its turn); and a delivering replica starts again `round_trip` seconds after its update
    is applied (sending the push and reading the new parameters), without stopping the others.
    """
    bound = _check_staleness(staleness_bound)
    check_int("num_replicas (the data-axis size)", num_replicas, 1)
    rounds = rounds or (lambda update: ("step",))
    cost = cost or (lambda variant: UNIT)
    round_trip, service, free = 0.0, 0.0, 0.0  # free: when the real server is done with its last update
    if server is not None:
        cost, round_trip, service = (lambda variant: StepCost(compute=server[0])), server[1], server[2]
    rows = _Rows(stragglers, num_replicas)
    replicas = range(num_replicas)
    tolerance = TIME_TOLERANCE * cost(rounds(0)[-1]).compute
    done = [0] * num_replicas  # steps each worker has started, i.e. its next row
    read = [0] * num_replicas  # version each worker's current (or delivered) gradient was computed on
    start = [0.0] * num_replicas  # when each worker started its current round
    partial: list[list[float]] = [[] for _ in replicas]  # each worker's clock after each step of its round
    finish = [0.0] * num_replicas
    computing = [True] * num_replicas
    pending: list[int] = []
    version = 0

    def begin(i: int, at: float) -> None:
        variants = rounds(version)
        if len(variants) > 1 and bound:
            raise ConfigError("a round of several steps needs staleness bound 0 (replicas that meet)")
        clock, marks = at, []
        for s, variant in enumerate(variants):
            step_cost = cost(variant)
            clock += rows.factor(done[i], i) * step_cost.compute + (step_cost.exposed if s < len(variants) - 1 else 0.0)
            done[i] += 1
            marks.append(clock)
        start[i], partial[i], finish[i], computing[i], read[i] = at, marks, clock, True, version

    for i in replicas:
        begin(i, 0.0)
    while True:
        now = min(finish[i] for i in replicas if computing[i])
        for i in replicas:
            if computing[i] and finish[i] <= now + tolerance:
                computing[i] = False
                pending.append(i)
                if server:  # one arrival at a time; a tie arrives next, at the same instant
                    break
        # Checking only the oldest in-flight read is enough: it is the one the next update makes most stale.
        oldest = min((read[i] for i in replicas if computing[i]), default=None)
        if oldest is not None and version + 1 - oldest > bound:
            continue  # wait for the next arrival; at worst until the worker holding the bound delivers
        steps = len(partial[pending[0]])
        everyone = np.ones(num_replicas, bool)
        for s in range(steps - 1):  # a round's local steps: no common clock, the mean of the replicas' clocks
            yield Update(everyone, np.zeros(num_replicas, np.int64), float(np.mean([partial[i][s] for i in replicas])))
        comm = cost(rounds(version)[-1]).exposed
        participants = np.zeros(num_replicas, bool)
        staleness = np.zeros(num_replicas, np.int64)
        participants[pending] = True
        staleness[pending] = [version - read[i] for i in pending]
        completed = max(now, free) + service + comm
        free = completed
        yield Update(participants, staleness, float(completed))
        version += 1
        for i in replicas:
            if computing[i]:
                finish[i] += comm  # the update's communication stops the world
        for i in pending:
            begin(i, completed + round_trip)
        pending = []
        rows.forget_before(min(done) - 1)


def simulate_ps(stragglers: Stragglers, num_replicas: int, staleness_bound: int | None,
                num_updates: int) -> list[Update]:
    """The first `num_updates` updates of a parameter server with unit compute and free communication (`simulate`);
    `staleness_bound` None = ASP, 0 = BSP, S = SSP(S)."""
    _check_staleness(staleness_bound)
    check_int("num_replicas (the data-axis size)", num_replicas, 1)
    check_int("num_updates", num_updates, 0)
    check_update_count(num_updates)
    return list(itertools.islice(simulate(stragglers, num_replicas, staleness_bound), num_updates))


def simulate_server(stragglers: Stragglers, num_replicas: int, staleness_bound: int | None, num_updates: int,
                    compute: float = 1.0, round_trip: float = 0.0, service: float = 0.0) -> list[Update]:
    """The first `num_updates` updates of the real parameter server (`simulate` with `server`): the emulator's
    projection of a `--runtime ray` run whose steps take `compute` seconds, whose server applies an update in
    `service` seconds, and whose pushes and pulls add `round_trip`."""
    _check_staleness(staleness_bound)
    check_int("num_replicas (the data-axis size)", num_replicas, 1)
    check_int("num_updates", num_updates, 0)
    check_update_count(num_updates)
    server = (compute, round_trip, service)
    return list(itertools.islice(simulate(stragglers, num_replicas, staleness_bound, server=server), num_updates))


def check_update_count(num_updates: int) -> None:
    if num_updates > MAX_SIMULATED_UPDATES:  # a server schedule is held whole before training
        raise OptionError("steps", num_updates, f"too many for ssp / asp, whose schedule is simulated on the host "
                          f"up front (at most {MAX_SIMULATED_UPDATES:,} updates); use {{steps}} "
                          f"{MAX_SIMULATED_UPDATES} or fewer")
