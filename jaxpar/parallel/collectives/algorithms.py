"""The allreduce algorithms by name: the list, the torus2d grid of an axis, and each algorithm's textbook traffic
(what `jaxpar.explain` compares the compiled HLO against)."""

from __future__ import annotations

import math

from jaxpar.checks import is_int
from jaxpar.errors import OptionError

ALLREDUCE_ALGORITHMS = ("psum", "ring", "torus2d", "ps")


def check_algorithm(algorithm: str) -> None:
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise OptionError("allreduce", algorithm, f"is not one of: {', '.join(ALLREDUCE_ALGORITHMS)}")


def default_torus_x(n: int) -> int:
    """The divisor of `n` closest to sqrt(n) (the smaller on a tie): the squarest grid has the fewest steps.

    A prime `n` gives 1, i.e. torus2d degenerates to a plain ring over Y = n devices.
    """
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - math.sqrt(n)), d))


def torus_shape(n: int, torus_x: int | None) -> tuple[int, int]:
    """(X, Y) of the torus2d grid over `n` devices; a `torus_x` that does not divide `n` is a ConfigError."""
    x = default_torus_x(n) if torus_x is None else torus_x
    if not is_int(x) or x < 1 or n % x:
        divisors = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        raise OptionError("torus_x", torus_x, f"does not divide the data axis size {n}; use one of: {divisors}",
                          flag="--torus")
    return x, n // x


def theoretical_traffic(algorithm: str, n: int, nbytes: int, torus_x: int | None = None) -> dict:
    """Textbook cost of averaging an `nbytes` buffer over `n` devices (no padding, no latency model).

    Returns dict(steps=sequential communication rounds, bytes_sent_per_device=bytes the busiest device sends,
    note=one line of context), the numbers `jaxpar.explain` compares the compiled HLO against.
    """
    check_algorithm(algorithm)
    ring = dict(steps=2 * (n - 1), bytes_sent_per_device=2 * (n - 1) / n * nbytes)
    if algorithm == "psum":
        return dict(ring, note="native all-reduce; shown: what a bandwidth-optimal (ring) all-reduce achieves")
    if algorithm == "ring":
        return dict(ring, note="reduce-scatter + all-gather around one ring")
    if algorithm == "torus2d":
        x, y = torus_shape(n, torus_x)
        return dict(steps=2 * (x - 1) + 2 * (y - 1),
                    bytes_sent_per_device=2 * (x - 1) / x * nbytes + 2 * (y - 1) / (x * y) * nbytes,
                    note=f"{x}x{y} torus: reduce-scatter along X, allreduce along Y on 1/X, all-gather along X")
    return dict(steps=2 * (n - 1), bytes_sent_per_device=float((n - 1) * nbytes),
                note=f"root receives and sends {(n - 1) * nbytes} bytes, one worker at a time; workers send {nbytes}")
