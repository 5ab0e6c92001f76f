"""The runtime's real schedule, and its replay through the emulation.

The server logs every update as the deliveries it applied: (worker, seq, version read). Replaying that schedule
through the emulated `ASP` strategy (`replay_strategy`: the same participants and staleness at every update) on the
batches the workers used (`replay_batches`) gives the runtime's parameters: the emulation is the runtime's exact
semantics, and this is how the tests prove it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxpar.strategies import ASP
from jaxpar.strategies.simulation import Update


class Delivery(NamedTuple):
    worker: int
    seq: int  # the worker's batch number
    read: int  # the version its gradient was computed on


def as_updates(schedule, num_workers: int) -> list[Update]:
    """The schedule (a list of updates, each a list of deliveries) as the event simulation's `Update`s."""
    updates = []
    for version, deliveries in enumerate(schedule):
        participants = np.zeros(num_workers, bool)
        staleness = np.zeros(num_workers, np.int64)
        for worker, _, read in deliveries:
            participants[worker], staleness[worker] = True, version - read
        updates.append(Update(participants, staleness, float(version + 1)))
    return updates


class Replayed(ASP):
    """The emulated parameter server on a given schedule instead of a simulated one."""

    def __init__(self, schedule, num_workers: int):
        self._updates = as_updates(schedule, num_workers)
        largest = max((int(u.staleness.max()) for u in self._updates), default=0)
        super().__init__(horizon=max(len(self._updates), 1))
        self._buffers = {num_workers: largest + 1}

    def schedule(self, num_replicas: int, updates: int):
        return self._updates


def replay_strategy(schedule, num_workers: int) -> Replayed:
    return Replayed(schedule, num_workers)


def replay_batches(schedule, batches, num_workers: int) -> list[dict]:
    """The global batch of every update: each delivering worker's rows are the batch it computed on; a worker that
    delivers nothing gets its batch 0 (masked out by the emulation)."""
    out = []
    for deliveries in schedule:
        seq = {worker: s for worker, s, _ in deliveries}
        parts = [batches(w, num_workers, seq.get(w, 0)) for w in range(num_workers)]
        out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    return out
