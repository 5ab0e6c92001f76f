"""Host-side simulation of slow workers: who delivers a gradient in each server update, and when (DESIGN.md §5).

The emulated asynchronous strategies (ASP, SSP, and BSP as SSP with S = 0) run on a mesh whose devices are in
lock step, so the asynchrony itself is simulated here, on the host, before training: a parameter server with a
version counter, workers that need `c_i` simulated seconds per gradient, and the staleness rule. The result is a
deterministic schedule (a list of `Update`s) that the device step replays: replicas that deliver nothing in an
update are masked out, and each participant reads the parameter version `staleness` updates old.

Pure Python + numpy on purpose: no JAX, so the schedule is cheap, testable alone and identical on every process.

    >>> s = parse_stragglers("3:2.0")
    >>> [u.sim_time for u in simulate_ps(s, num_replicas=4, staleness_bound=None, num_updates=3)]
    [1.0, 2.0, 3.0]
    >>> simulate_ps(s, 4, None, 2)[1].staleness.tolist()   # replica 3 computed on version 0, applied after update 0
    [0, 0, 0, 1]
    >>> bsp_times(s, 4, 3).tolist()                         # sync SGD waits for the slowest replica every step
    [2.0, 4.0, 6.0]
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from jaxpar.errors import ConfigError, OptionError

# Arrivals closer than this are the same instant: sums of float compute times may differ in the last bits.
TIME_TOLERANCE = 1e-9

# Bounds that keep every simulated time finite (and sane) over any run: a compute time is at most
# MAX_SLOWDOWN x e^(MAX_JITTER x |z|); |z| > 9 has probability < 1e-18 per draw, and exp overflows only past 709.
MAX_SLOWDOWN = 1e6
MAX_JITTER = 10.0
MAX_SIMULATED_UPDATES = 10 ** 6  # ~35 s and ~200 MB of host time and memory on this machine

_SPEC_HELP = ("expected comma-separated REPLICA:SLOWDOWN items plus optional jitter=J and seed=N, "
              "e.g. '3:2.0,5:1.5,jitter=0.1'")


@dataclass(frozen=True)
class Stragglers:
    """A straggler profile: replica -> slowdown factor (others 1.0), log-normal jitter and the seed of that jitter."""

    slowdown: dict[int, float] = field(default_factory=dict, hash=False)  # a dict is unhashable; equality still uses it
    jitter: float = 0.0  # std of the log of each compute time: c = slowdown * exp(jitter * z), z ~ N(0, 1)
    seed: int = 0  # the jitter's random stream; same seed -> same schedule
    spec: str = field(default="", compare=False)  # as written, for messages

    def check(self, num_replicas: int) -> "Stragglers":
        """A slow replica must exist on the data axis; caught here because the spec is parsed before the mesh."""
        for replica in self.slowdown:
            if not 0 <= replica < num_replicas:
                raise OptionError("stragglers", self.spec or self.slowdown, f"replica {replica} does not exist; the data axis has "
                                  f"size {num_replicas}, so use replicas 0..{num_replicas - 1}")
        return self

    def factors(self, num_replicas: int) -> np.ndarray:
        """The slowdown of every replica as a [num_replicas] array (1.0 where the profile says nothing)."""
        self.check(num_replicas)
        out = np.ones(num_replicas)
        for replica, factor in self.slowdown.items():
            out[replica] = factor
        return out


def parse_stragglers(spec: str | None) -> Stragglers:
    """Parses the `--stragglers` flag: "3:2.0,5:1.5,jitter=0.1,seed=7". None or "" means nobody is slow."""
    if spec is None or not spec.strip():
        return Stragglers()
    slowdown: dict[int, float] = {}
    jitter, seed = 0.0, 0

    def bad(why: str) -> ConfigError:
        return OptionError("stragglers", spec, why)

    for raw in spec.split(","):
        item = raw.strip()
        key, sep, value = item.partition("=") if "=" in item else item.partition(":")
        key, value = key.strip(), value.strip()
        try:
            if sep == "=" and key == "jitter":
                jitter = float(value)
            elif sep == "=" and key == "seed":
                seed = int(value)
            elif sep == ":":
                replica, factor = int(key), float(value)
            else:
                raise ValueError(item)
        except ValueError:
            raise bad(f"cannot read {item!r}; {_SPEC_HELP}") from None
        if key == "jitter" and not 0 <= jitter <= MAX_JITTER:
            raise bad(f"jitter {value} must be a finite number >= 0 and at most {MAX_JITTER:g} (the std of the log "
                      f"of a compute time; {MAX_JITTER:g} already spreads times over e^+-{3 * MAX_JITTER:g}), "
                      f"e.g. jitter=0.1")
        if key == "seed" and seed < 0:
            raise bad(f"seed {value} must be an integer >= 0, e.g. seed=7")
        if sep == ":":
            if replica < 0:
                raise bad(f"replica {replica} must be >= 0 (a data-axis index)")
            if replica in slowdown:
                raise bad(f"replica {replica} is given twice; give each replica one slowdown")
            if not 0 < factor <= MAX_SLOWDOWN:
                raise bad(f"slowdown {value} of replica {replica} must be a finite number > 0 and at most "
                          f"{MAX_SLOWDOWN:g} (2.0 = twice as slow), e.g. {replica}:2.0")
            slowdown[replica] = factor
    return Stragglers(slowdown, jitter, seed, spec)


def compute_times(stragglers: Stragglers, num_replicas: int, count: int) -> np.ndarray:
    """[count, num_replicas] simulated seconds; replica i's k-th gradient costs row k, column i.

    Rows are drawn in order from one seeded stream, so the first k rows do not depend on `count`: a longer
    simulation extends a shorter one instead of reshuffling it.
    """
    factors = stragglers.factors(num_replicas)
    z = np.random.default_rng(stragglers.seed).standard_normal((count, num_replicas))
    return 1.0 * factors * np.exp(stragglers.jitter * z)


class Update(NamedTuple):
    """One server update: an optimizer step on the mean gradient of its participants."""

    participants: np.ndarray  # bool [R]: replicas whose gradient is in this update
    staleness: np.ndarray  # int [R]: updates between the version read and the one applied to; 0 if not participating
    sim_time: float  # the simulated instant the update is applied


def _check_staleness(staleness_bound) -> float:
    if staleness_bound is None or staleness_bound == math.inf:
        return math.inf
    if isinstance(staleness_bound, bool) or not isinstance(staleness_bound, (int, np.integer)) or staleness_bound < 0:
        raise OptionError("staleness", staleness_bound, "must be an integer >= 0 (0 = BSP), or unset for ASP "
                          "(no bound)")
    return int(staleness_bound)


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(f"{name} {value!r}: must be an integer >= {low}")


def simulate_ps(stragglers: Stragglers, num_replicas: int, staleness_bound: int | None,
                num_updates: int) -> list[Update]:
    """The parameter-server event simulation of DESIGN.md §5; `staleness_bound` None = ASP, 0 = BSP, S = SSP(S).

    Workers start on version 0 at t = 0. At each arrival instant every worker finishing then delivers into a pending
    set and idles. The server applies the whole pending set as one update unless that would push some in-flight
    gradient's staleness over S, i.e. (V + 1) - version_read > S; then it waits for more arrivals (fast workers
    idle). After an update, exactly the delivering workers start their next gradient, on the new version.
    The bound holds for delivered gradients too: each was in flight at every earlier update, so V - read <= S.
    """
    bound = _check_staleness(staleness_bound)
    _check_int("num_replicas (the data-axis size)", num_replicas, 1)
    _check_int("num_updates", num_updates, 0)
    if num_updates > MAX_SIMULATED_UPDATES:  # the whole list is simulated and held before training
        raise OptionError("steps", num_updates, f"too many for ssp / asp, whose schedule is simulated on the host "
                          f"up front (at most {MAX_SIMULATED_UPDATES:,} updates); use {{steps}} {MAX_SIMULATED_UPDATES} "
                          f"or fewer")
    # A worker delivers at most once per update, plus one gradient in flight: num_updates + 1 rows suffice.
    costs = compute_times(stragglers, num_replicas, num_updates + 1).tolist()
    replicas = range(num_replicas)
    finish = [costs[0][i] for i in replicas]  # simulated finish time of each worker's current gradient
    read = [0] * num_replicas  # version each worker's current (or delivered) gradient was computed on
    done = [0] * num_replicas  # gradients each worker has started, i.e. its next row in `costs`
    computing = [True] * num_replicas
    pending: list[int] = []
    version, updates = 0, []
    while len(updates) < num_updates:
        now = min(finish[i] for i in replicas if computing[i])
        for i in replicas:
            if computing[i] and finish[i] <= now + TIME_TOLERANCE:
                computing[i] = False
                pending.append(i)
        # Checking only the oldest in-flight read is enough: it is the one the next update makes most stale.
        oldest = min((read[i] for i in replicas if computing[i]), default=None)
        if oldest is not None and version + 1 - oldest > bound:
            continue  # wait for the next arrival; at worst until the worker holding the bound delivers
        participants = np.zeros(num_replicas, bool)
        staleness = np.zeros(num_replicas, np.int64)
        participants[pending] = True
        staleness[pending] = [version - read[i] for i in pending]
        updates.append(Update(participants, staleness, float(now)))
        version += 1
        for i in pending:
            done[i] += 1
            read[i], finish[i], computing[i] = version, now + costs[done[i]][i], True
        pending = []
    return updates


CHUNK_ROWS = 4096  # rows of compute times drawn at a time by the lazy clock


def _cost_rows(stragglers: Stragglers, num_replicas: int):
    """Endless rows of `compute_times`, drawn CHUNK_ROWS at a time from the same seeded stream (the same numbers as
    one big `compute_times` call: a stream drawn in pieces is the stream drawn at once)."""
    factors = stragglers.factors(num_replicas)
    rng = np.random.default_rng(stragglers.seed)
    while True:
        yield from 1.0 * factors * np.exp(stragglers.jitter * rng.standard_normal((CHUNK_ROWS, num_replicas)))


def bsp_clock(stragglers: Stragglers, num_replicas: int, period: int = 1, sync_steps: int = 0):
    """The simulated clock after each step, lazily and forever: memory stays O(replicas) whatever the step count.

    The first `sync_steps` steps meet every step (post-local SGD's synchronous phase), the rest every `period` steps
    (counted from the end of the synchronous phase). One cost stream for the whole run: step k uses row k.
    """
    _check_int("num_replicas (the data-axis size)", num_replicas, 1)
    _check_int("period (steps between replica meetings)", period, 1)
    _check_int("sync_steps", sync_steps, 0)
    clocks = np.zeros(num_replicas)
    for k, row in enumerate(_cost_rows(stragglers, num_replicas)):
        clocks += row
        if k < sync_steps or (k - sync_steps + 1) % period == 0:
            clocks[:] = clocks.max()
            yield float(clocks[0])
        else:
            yield float(clocks.mean())


def bsp_times(stragglers: Stragglers, num_replicas: int, num_steps: int, period: int = 1) -> np.ndarray:
    """[num_steps] simulated clock after each step when replicas meet every `period` steps (`bsp_clock`'s first
    `num_steps` values; prefer `bsp_clock` for long runs, whose length you do not need up front).

    Sync SGD (period 1) pays the slowest replica every step. Local SGD (period H) lets each replica run its H steps
    at its own pace and pays the wait only at the meeting: clock = last meeting + max over replicas of their time
    since it. Between meetings there is no common clock, so those steps report the mean of the replicas' clocks.
    """
    _check_int("num_replicas (the data-axis size)", num_replicas, 1)
    _check_int("num_steps", num_steps, 0)
    _check_int("period (steps between replica meetings)", period, 1)
    return np.fromiter(itertools.islice(bsp_clock(stragglers, num_replicas, period), num_steps), np.float64,
                       num_steps)
