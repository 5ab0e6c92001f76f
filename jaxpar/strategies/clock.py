"""A strategy's simulated clock (`sim_time`): the event simulation (`jaxpar.strategies.simulation`) per replica
count, memoised, optionally priced per step variant; and the meeting rounds of strategies whose replicas meet on a
fixed schedule (sync SGD every step, local SGD every H steps)."""

from __future__ import annotations

import array
import itertools

import numpy as np

from jaxpar.checks import check_int
from jaxpar.strategies.simulation import simulate
from jaxpar.strategies.stragglers import as_stragglers


class Clock:
    """The simulated clock of a strategy: `simulation.simulate` per replica count, memoised and only ever extended
    (the first k steps never change), so `sim_time` is a pure function of (replica count, step number).

    `schedule` holds the whole `Update`s (who delivers, how stale) at unit cost, which is all a server strategy
    replays; they never depend on the profile. `time_after` reads the clock priced by `cost` (variant -> its
    `jaxpar.strategies.simulation.StepCost`): a trainer with a hardware profile prices its own copy (`priced`) from
    its compiled steps; without one every step costs one unit and communication is free."""

    def __init__(self, stragglers, staleness_bound: int | None = 0, rounds=None, cost=None):
        self.stragglers, self.bound, self.rounds = as_stragglers(stragglers), staleness_bound, rounds
        self.cost = cost
        self._schedules: dict[int, tuple] = {}  # replica count -> (stream, list of Updates)
        self._times: dict[int, tuple] = {}  # replica count -> (priced stream, array of sim_time)
        self._uniform_for: dict[int, bool] = {}  # replica count -> no straggler among them

    def priced(self, cost) -> "Clock":
        """The same clock with every step priced by `cost(variant)` (None: unit cost); this one is unchanged."""
        clock = Clock(self.stragglers, self.bound, self.rounds, cost)
        clock._schedules = self._schedules  # unit-cost schedules never depend on the price
        return clock

    def _uniform(self, num_replicas: int) -> bool:
        """No straggler among `num_replicas` replicas: no slowdown, no jitter."""
        if num_replicas not in self._uniform_for:
            self._uniform_for[num_replicas] = (self.stragglers.jitter == 0
                                               and bool(np.all(self.stragglers.factors(num_replicas) == 1.0)))
        return self._uniform_for[num_replicas]

    def schedule(self, num_replicas: int, steps: int) -> list:
        """The first `steps` (at least) simulated steps at unit cost."""
        stream, known = self._schedules.get(num_replicas) or (None, [])
        if stream is None:
            stream = simulate(self.stragglers, num_replicas, self.bound, self.rounds)
            self._schedules[num_replicas] = (stream, known)
        known.extend(itertools.islice(stream, max(0, steps - len(known))))
        return known

    def _server_time(self, num_replicas: int, step_number: int) -> float:
        """A server's clock: its unit-cost schedule priced update by update. Communication stops the world, so with
        compute C and communication M per update the clock advances C x (the unit schedule's advance) + M: the
        schedule the device replays and the one timed are the same by construction."""
        schedule = self.schedule(num_replicas, step_number + 1)
        if self.cost is None:
            return schedule[step_number].sim_time
        _, times = self._times.setdefault(num_replicas, (None, array.array("d")))
        while len(times) <= step_number:
            n = len(times)
            cost = self.cost(self.rounds(n)[-1])
            advance = schedule[n].sim_time - (schedule[n - 1].sim_time if n else 0.0)
            times.append((times[-1] if n else 0.0) + cost.compute * advance + cost.exposed)
        return times[step_number]

    def time_after(self, num_replicas: int, step_number: int) -> float:
        """Simulated seconds when the step with that (0-based) number completes."""
        if self.bound != 0:
            return self._server_time(num_replicas, step_number)
        if self.cost is None and self._uniform(num_replicas):
            # every replica takes one unit per step and communication is free: the simulator's clock is the step
            # count (tests/strategies/test_simulator.py checks it against `simulate`); spares `trainer.step` the
            # simulator's per-update work, about 20-100 us on the host per step
            return float(step_number + 1)
        stream, times = self._times.get(num_replicas) or (None, array.array("d"))
        if stream is None:
            stream = simulate(self.stragglers, num_replicas, self.bound, self.rounds, self.cost)
            self._times[num_replicas] = (stream, times)
        if step_number >= len(times):
            # unit cost: extended geometrically; priced: only as far as asked, so every step is priced with its
            # variants' costs when it runs (a new batch shape re-prices the steps after it, never the ones before)
            wanted = (max(2 * step_number + 1, 1024) if self.cost is None else step_number + 1) - len(times)
            times.extend(u.sim_time for u in itertools.islice(stream, wanted))
        return times[step_number]


def meeting_rounds(period: int = 1, sync_steps: int = 0):
    """`simulate`'s rounds for replicas that meet every step for `sync_steps` steps (variant "sync"), then every
    `period` steps ("local" steps, then "meet"); period 1 from the start is sync SGD."""
    check_int("period (steps between replica meetings)", period, 1)
    check_int("sync_steps", sync_steps, 0)
    local = ("local",) * (period - 1) + ("meet",) if period > 1 else ("meet",)
    return lambda update: ("sync",) if update < sync_steps else local
