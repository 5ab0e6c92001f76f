"""How a step's attention runs over the seq axis (`ContextParallel`), and the trace-time context that carries it to
`jaxpar.attention` inside a user's model.

A model calls `jaxpar.attention(q, k, v)` without a handle on the trainer, so the trainer enters `running(settings)`
around each trace of its steps (as `jax.set_mesh` carries a mesh to `shard_map`), and reads back afterwards whether
the helper ran: on a mesh with seq > 1, a model that never called it would attend within its own block only, which
is a `ModelError` rather than silently wrong attention.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import Any

from jaxpar.errors import ConfigError, MeshError, ModelError
from jaxpar.parallel import mesh as mesh_lib

ALLGATHER, RING, ULYSSES = "allgather", "ring", "ulysses"
ALGORITHMS = (ALLGATHER, RING, ULYSSES)
# The default: every device gathers K and V once per layer, one collective XLA schedules freely, and no per-head
# divisibility; the ring only pays off when a layer's whole K/V no longer fits beside the activations (memory
# O(L / seq) instead of O(L)), and Ulysses needs heads divisible by seq.
DEFAULT = ALLGATHER


@dataclass(frozen=True)
class ContextParallel:
    """`algorithm`: allgather | ring | ulysses; `zigzag`: the ring's causal load balance (device i computes the
    sequence's chunks i and 2S-1-i of 2S); `mesh`: the trainer's mesh (set by the trainer)."""
    algorithm: str = DEFAULT
    zigzag: bool = True
    mesh: Any = None

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"context parallel algorithm {self.algorithm!r}: choose one of {', '.join(ALGORITHMS)}")

    @property
    def ways(self) -> int:
        return 1 if self.mesh is None else mesh_lib.seq_ways(self.mesh)

    @property
    def balanced(self) -> bool:
        """Whether the ring re-lays the sequence zig-zag (only the ring skips masked blocks, so only it needs to)."""
        return self.zigzag and self.algorithm == RING


class _Trace:
    """What one trace saw: the helper's calls (the model used it) and the sequence lengths it was given."""

    def __init__(self, settings: ContextParallel):
        self.settings, self.calls = settings, 0
        self.shapes: list = []  # (q's global shape, its dtype) of each call (the cost model's theory reads them)


_CURRENT: contextvars.ContextVar[_Trace | None] = contextvars.ContextVar("jaxpar_context_parallel", default=None)


@contextlib.contextmanager
def running(settings: ContextParallel):
    """The helper's settings while a step is traced; yields the trace record (its `calls`)."""
    trace = _Trace(settings)
    token = _CURRENT.set(trace)
    try:
        yield trace
    finally:
        _CURRENT.reset(token)


def current() -> _Trace | None:
    return _CURRENT.get()


def check_length(length: int, ways: int, balanced: bool = False, what: str = "the sequence") -> None:
    """A sequence of `length` positions must split into equal blocks over `ways` seq devices (two chunks per device
    for the zig-zag ring, `balanced`): one line naming the length, the axis and what would work."""
    chunks = ways * (2 if balanced else 1)
    if length < ways:
        raise MeshError(f"--mesh {mesh_lib.SEQ_AXIS}={ways}: {what} has only {length} positions, fewer than the "
                        f"{ways} devices it is split over; use a smaller {mesh_lib.SEQ_AXIS} axis or a longer "
                        f"--seq-len")
    if length % chunks:
        how = " x 2 chunks per device for the zig-zag ring" if balanced else ""
        raise ConfigError(f"--seq-len {length}: {what} does not split over {mesh_lib.SEQ_AXIS}={ways}{how}; use a "
                          f"multiple of {chunks}, e.g. --seq-len {max(chunks, length // chunks * chunks)}")


def check_heads(heads: int, ways: int, algorithm: str) -> None:
    if algorithm == ULYSSES and heads % ways:
        raise ConfigError(f"--context-parallel {ULYSSES}: {heads} attention heads do not divide over "
                          f"{mesh_lib.SEQ_AXIS}={ways} (Ulysses gives each device heads / seq whole heads); use a "
                          f"head count (--heads) that divides by {ways}, or --context-parallel {ALLGATHER}")


def traced(fn, settings: ContextParallel):
    """`fn` (a step or an evaluation, traced by jit) run under `running(settings)`; on a mesh with seq > 1, a trace
    in which the model never called `jaxpar.attention` is a `ModelError`: its attention would see one block."""
    if settings.ways == 1:
        return fn

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with running(settings) as trace:
            out = fn(*args, **kwargs)
        if not trace.calls:
            raise ModelError(f"--mesh {mesh_lib.SEQ_AXIS}={settings.ways}: the model never called jaxpar.attention, "
                             f"so its attention would see only each device's block of the sequence; call "
                             f"jaxpar.attention(q, k, v) for attention (the built-in transformer does), or use a "
                             f"mesh without {mesh_lib.SEQ_AXIS}")
        return out

    return run


def settings_for(value, mesh) -> ContextParallel:
    """`Trainer(context_parallel=...)`: None (the default algorithm), an algorithm's name or a `ContextParallel`,
    bound to the trainer's mesh."""
    if value is None:
        value = ContextParallel()
    elif isinstance(value, str):
        value = ContextParallel(value)
    elif not isinstance(value, ContextParallel):
        raise ConfigError(f"context_parallel {value!r}: give one of {', '.join(ALGORITHMS)} or a "
                          f"jaxpar.parallel.context.ContextParallel")
    return ContextParallel(value.algorithm, value.zigzag, mesh)
