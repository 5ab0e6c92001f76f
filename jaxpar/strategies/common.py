"""What every strategy shares: its averaging algorithm (a communicator), the straggler profile, and the simulated
clock of strategies whose replicas meet on a fixed schedule (sync SGD every step, local SGD every H steps)."""

from __future__ import annotations

import numbers

import numpy as np

from jaxpar.collectives import Communicator
from jaxpar.collectives import communicator as make_communicator
from jaxpar.errors import ConfigError
from jaxpar.strategies.simulator import Stragglers, bsp_times, parse_stragglers


def check_int(where: str, value, low: int, why: str = "", optional: bool = False) -> None:
    """Refuses anything but an integer >= `low` (bools included: `period=True` is a mistake, not 1).

    `where` names the argument as it is written, e.g. "LocalSGD(period=...)"; `optional`: None is allowed.
    """
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        shown = where.replace("...", repr(value))
        raise ConfigError(f"{shown}: must be an integer >= {low}{f' ({why})' if why else ''}")


def as_stragglers(stragglers) -> Stragglers:
    return stragglers if isinstance(stragglers, Stragglers) else parse_stragglers(stragglers)


class StrategyBase:
    """Holds `communicator` (None = the compiler's all-reduce) and `stragglers`; checks them against the mesh."""

    OPTIONS: dict = {}
    local_statistics = True

    def __init__(self, allreduce, torus_x, stragglers):
        cls = type(self).__name__
        if allreduce is not None and not isinstance(allreduce, (str, Communicator)):
            raise ConfigError(f"{cls}(allreduce={allreduce!r}): must be None or one of 'psum', 'ring', 'torus2d', "
                              f"'ps' (or a jaxpar.Communicator)")
        check_int(f"{cls}(torus_x=...)", torus_x, 1, "X of the X x Y torus2d grid", optional=True)
        if stragglers is not None and not isinstance(stragglers, (str, Stragglers)):
            raise ConfigError(f"{cls}(stragglers={stragglers!r}): must be None or a profile string like '3:2.0' "
                              f"(replica 3 is 2x slower)")
        if torus_x is not None and allreduce is None:
            make_communicator("psum", torus_x)  # raises: a torus X applies only to torus2d
        self.communicator = None if allreduce is None else make_communicator(allreduce, torus_x)
        self.stragglers = as_stragglers(stragglers)

    @property
    def allreduce(self) -> str | None:
        return None if self.communicator is None else self.communicator.name

    @property
    def torus_x(self) -> int | None:
        return None if self.communicator is None else self.communicator.torus_x

    def check_against_mesh(self, ctx) -> None:
        """The checks that need the replica count, run when the trainer is built (before anything compiles)."""
        self.stragglers.check(ctx.num_replicas)
        if self.communicator is not None:
            self.communicator.check(ctx.num_replicas)

    def init_comm_state(self, params):
        return () if self.communicator is None else self.communicator.init(params)


class SimulatedClock:
    """Host-side simulated seconds after each step for replicas that meet every step for the first `sync_steps`
    steps and every `period` steps after that (sync SGD: period 1; post-local SGD: sync_steps = K).

    A pure function of (replica count, step number): the memo is keyed by the replica count and only ever extended
    (the first k entries never change)."""

    def __init__(self, stragglers, period: int = 1, sync_steps: int = 0):
        self.stragglers, self.period, self.sync_steps = as_stragglers(stragglers), period, sync_steps
        self._times: dict[int, np.ndarray] = {}

    def time_after(self, num_replicas: int, step_number: int) -> float:
        times = self._times.get(num_replicas, np.zeros(0))
        if step_number >= len(times):  # extended geometrically
            total = max(2 * step_number + 1, 1024)  # never the whole synchronous prefix at once: it may be huge
            synced = bsp_times(self.stragglers, num_replicas, min(self.sync_steps, total), 1)
            start = synced[-1] if len(synced) else 0.0
            local = start + bsp_times(self.stragglers, num_replicas, total - len(synced), self.period)
            times = self._times[num_replicas] = np.concatenate([synced, local])
        return float(times[step_number])
