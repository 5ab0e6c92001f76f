"""The plans the advisor weighs: the meshes of N devices, the strategies priced on each (and how each is priced),
and the `Candidate` a priced plan becomes."""

from __future__ import annotations

from typing import NamedTuple

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.strategies import DiLoCo, LocalSGD, Sync

DEFAULT_PERIODS = (4, 16)
DEFAULT_REMATS = ("none", "full")
DEFAULT_CODECS = ("bf16", "int8", "powersgd:4")  # sync with an explicit allreduce, its exchange compressed
ALGORITHMS = ("ring", "torus2d", "ps")  # the hand-written allreduces priced against the compiler's

# how a strategy is priced from a mesh's one compiled sync step (`jaxpar.advisor.advise`)
COMPILED, ALLREDUCE, COMPRESS, PERIOD = "compiled", "allreduce", "compress", "period"


class Candidate(NamedTuple):
    """One plan: the flags that run it and what the advisor projects for it."""

    mesh: str  # a --mesh spec
    strategy: str  # e.g. "sync", "sync allreduce=ring", "local_sgd H=4"
    flags: str  # the run.py flags that run it
    remat: str
    seconds: float  # projected seconds per step
    memory: int  # bytes per device (compiled, or estimated: see `estimated`)
    fits: bool
    steps_ratio: float | None  # steps to the target loss relative to sync (None: not known)
    parts: dict  # compute / communication / exchange seconds, and what was estimated
    why: str = ""  # why it loses (set when ranked)


class Choice(NamedTuple):
    """A strategy the advisor prices on every mesh."""

    label: str  # how its steps ratio is looked up and how it is shown, e.g. "sync allreduce=ring"
    strategy: object  # the strategy instance
    flags: str  # the run.py flags that choose it
    how: str  # COMPILED (the mesh's own step), ALLREDUCE, COMPRESS or PERIOD
    algorithm: str | None = None  # ALLREDUCE, COMPRESS: the hand-written allreduce
    codec: str | None = None  # COMPRESS: the codec
    period: int | None = None  # PERIOD: how many steps between meetings

    @property
    def ratio_labels(self) -> tuple[str, ...]:
        """The `steps_ratio` keys that give its steps to target, first found first: a codec's ratio is shared by
        every algorithm it compresses ("sync compress=CODEC")."""
        return (self.label, f"{Sync.name} compress={self.codec}") if self.how == COMPRESS else (self.label,)


def factorizations(devices: int, axes: int = 3) -> list[tuple[int, ...]]:
    """Every ordered way to write `devices` as a product of `axes` positive integers."""
    if axes == 1:
        return [(devices,)]
    return [(d,) + rest for d in range(1, devices + 1) if devices % d == 0
            for rest in factorizations(devices // d, axes - 1)]


LONG_SEQUENCE = 1024  # examples of at least this many positions: the advisor weighs meshes with a seq axis too


def long_sequence(batch) -> bool:
    """Whether a batch's examples are long sequences (an array [B, L, ...] with L >= `LONG_SEQUENCE`): then one
    sequence's activations may not fit a device, and splitting it over seq is a plan worth pricing."""
    return any(len(getattr(v, "shape", ())) >= 2 and v.shape[1] >= LONG_SEQUENCE for v in batch.values())


def mesh_specs(devices: int, stages: bool = False, seq: bool = False) -> list[str]:
    """The --mesh specs of every factorisation (data, fsdp, model; with `stages`, stage too; with `seq`, seq too),
    data-only first."""
    roles = ((mesh_lib.DATA,) + ((mesh_lib.STAGE,) if stages else ()) + (mesh_lib.FSDP,)
             + ((mesh_lib.SEQ,) if seq else ()) + (mesh_lib.MODEL,))
    specs = []
    for sizes in sorted(factorizations(devices, len(roles)), key=lambda s: tuple(-x for x in s)):
        specs.append(",".join(f"{role}={size}" for role, size in zip(roles, sizes)))
    return specs


def strategy_choices(periods, codecs=DEFAULT_CODECS) -> list[Choice]:
    """Every strategy the advisor prices: sync with the compiler's all-reduce, with each hand-written allreduce and
    each codec on it, and local SGD and DiLoCo at each period."""
    out = [Choice(Sync.name, Sync(), f"--strategy {Sync.name}", COMPILED)]
    for algorithm in ALGORITHMS:
        out.append(Choice(f"{Sync.name} allreduce={algorithm}", Sync(algorithm),
                          f"--strategy {Sync.name} --allreduce {algorithm}", ALLREDUCE, algorithm))
        for codec in codecs:
            out.append(Choice(f"{Sync.name} allreduce={algorithm} compress={codec}", Sync(algorithm, compress=codec),
                              f"--strategy {Sync.name} --allreduce {algorithm} --compress {codec}", COMPRESS,
                              algorithm, codec))
    for cls in (LocalSGD, DiLoCo):
        for h in periods:
            out.append(Choice(f"{cls.name} H={h}", cls(period=h), f"--strategy {cls.name} --sync-period {h}", PERIOD,
                              period=h))
    return out
