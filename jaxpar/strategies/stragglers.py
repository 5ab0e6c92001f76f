"""The straggler profile: which replicas are slow, by how much, and the seeded jitter of every compute time
(`--stragglers "3:2.0,5:1.5,jitter=0.1,seed=7"`). The event simulation (`jaxpar.strategies.simulation`) draws each
replica's step times from it.

    >>> s = parse_stragglers("3:2.0")
    >>> s.factors(4).tolist()
    [1.0, 1.0, 1.0, 2.0]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxpar.errors import ConfigError, OptionError

# Bounds that keep every simulated time finite (and sane) over any run: a compute time is at most
# MAX_SLOWDOWN x e^(MAX_JITTER x |z|); |z| > 9 has probability < 1e-18 per draw, and exp overflows only past 709.
MAX_SLOWDOWN = 1e6
MAX_JITTER = 10.0

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
                raise OptionError("stragglers", self.spec or self.slowdown, f"replica {replica} does not exist; the "
                                  f"data axis has size {num_replicas}, so use replicas 0..{num_replicas - 1}")
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


def as_stragglers(stragglers) -> Stragglers:
    """A `Stragglers` as it is, or parsed from its `--stragglers` string (None: nobody is slow)."""
    return stragglers if isinstance(stragglers, Stragglers) else parse_stragglers(stragglers)


def compute_times(stragglers: Stragglers, num_replicas: int, count: int) -> np.ndarray:
    """[count, num_replicas] simulated seconds; replica i's k-th gradient costs row k, column i.

    Rows are drawn in order from one seeded stream, so the first k rows do not depend on `count`: a longer
    simulation extends a shorter one instead of reshuffling it.
    """
    factors = stragglers.factors(num_replicas)
    z = np.random.default_rng(stragglers.seed).standard_normal((count, num_replicas))
    return 1.0 * factors * np.exp(stragglers.jitter * z)
