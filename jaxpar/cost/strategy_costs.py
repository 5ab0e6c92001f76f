"""What the cost model assumes of each strategy, in a table keyed by strategy class: the exchanges over the replica
axis each step variant should contain (`theory`: `explain`'s theory lines, and whether a priced step's gradient
average may overlap its backward pass), each variant's share of a long run's steps (`variant_shares`), and its
mean step time projected from another run's exchanging and local steps (`project`: `explain`'s comparison of
strategies, the plan advisor). A subclass takes its base's entry (DiLoCo LocalSGD's); `register` adds one.

A strategy whose class the table does not know (one of your own that implements only the core,
`jaxpar.strategies.Strategy`) is priced like sync SGD: every step variant averages a gradient-sized tree over the
replica axis once per step, with the strategy's communicator (absent or None: the compiler's all-reduce); each
variant's share is how often its plan picks it in the first `SAMPLED_STEPS` steps. `assumption` says so, and
`jaxpar.explain` prints it.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, NamedTuple

from jaxpar.errors import ConfigError
from jaxpar.strategies import ASP, SSP, LocalSGD, Sync

SAMPLED_STEPS = 1000  # the steps of an unknown strategy's plan its variant shares are counted over


class Expected(NamedTuple):
    """An exchange over the replica axis that theory says a step variant contains (for `explain`)."""

    what: str  # e.g. "gradient average"
    kind: str  # "all-reduce" (psum / ring / torus2d: 2(N-1)/N x bytes per device) or "ps" ((N-1) x bytes at the root)
    bytes: int  # the payload per replica
    share: float = 1.0  # how often per step (a meeting every H steps: 1/H)


class StrategyCosts(NamedTuple):
    """One strategy class's entry in the table."""

    shares: Callable  # (strategy, ctx) -> {variant: share of a long run's steps (None: a fixed number at the start)}
    theory: Callable  # (strategy, variant, gradient bytes) -> [Expected]: its exchanges over the replica axis
    project: Callable  # (exchange seconds, local seconds, period) -> (mean seconds per step, how)
    period: Callable = lambda strategy: 1  # steps between exchanges over the replica axis
    periodic: bool = False  # its replicas meet every H steps: a meeting averages after its step (no overlap)


def exchange(strategy, what: str, gradient_bytes: int, share: float = 1.0) -> Expected:
    """The replica-axis average of a params-shaped tree, sent by the strategy's communicator."""
    communicator = getattr(strategy, "communicator", None)
    algorithm = "psum" if communicator is None else communicator.name
    return Expected(what, "ps" if algorithm == "ps" else "all-reduce", gradient_bytes, share)


def _every_step(strategy, variant: str, gradient_bytes: int) -> list[Expected]:
    return [exchange(strategy, "gradients", gradient_bytes)]


def _sampled_shares(strategy, ctx) -> dict:
    if ctx is None:
        raise ConfigError(f"strategy {strategy.name!r}: its variants' shares are counted from its plan, which needs "
                          f"the trainer's context; pass trainer.ctx")
    counts = Counter(strategy.plan(ctx, n).variant for n in range(SAMPLED_STEPS))
    return {variant: count / SAMPLED_STEPS for variant, count in counts.items()}


def _local_sgd_shares(strategy, ctx) -> dict:
    """Post-local SGD's synchronous steps: the first K only (None)."""
    shares = {strategy.SYNC: None} if strategy.local_after else {}
    if strategy.period > 1:
        shares[strategy.LOCAL] = (strategy.period - 1) / strategy.period
    return {**shares, strategy.MEET: 1 / strategy.period}


def _local_sgd_theory(strategy, variant: str, gradient_bytes: int) -> list[Expected]:
    if variant == strategy.MEET:
        what = "outer gradients" if getattr(strategy.communicator, "codec", None) else "parameters"
        return [exchange(strategy, what, gradient_bytes, 1 / strategy.period)]
    return _every_step(strategy, variant, gradient_bytes) if variant == strategy.SYNC else []


def _local_sgd_project(exchange_seconds: float, local: float, period: int) -> tuple[float, str]:
    """H - 1 local steps, then a meeting; H is the other run's period, or local SGD's default."""
    h = period if period > 1 else LocalSGD.DEFAULT_PERIOD
    return ((h - 1) * local + exchange_seconds) / h, f"{h - 1} local steps, then a meeting (H = {h})"


SYNC_COSTS = StrategyCosts(
    shares=lambda strategy, ctx: {strategy.SYNC: 1.0}, theory=_every_step,
    project=lambda exchange_seconds, local, period: (
        exchange_seconds, "compute, within-replica collectives and the exchange over data every step"))
DEFAULT = SYNC_COSTS._replace(shares=_sampled_shares)

TABLE: dict[type, StrategyCosts] = {
    Sync: SYNC_COSTS,
    LocalSGD: StrategyCosts(_local_sgd_shares, _local_sgd_theory, _local_sgd_project,
                            period=lambda strategy: strategy.period, periodic=True),
    SSP: StrategyCosts(lambda strategy, ctx: {strategy.UPDATE: 1.0}, _every_step,
                       lambda exchange_seconds, local, period: (
                           exchange_seconds, "an exchange per update; with stragglers it waits less than sync")),
}
TABLE[ASP] = TABLE[SSP]._replace(project=lambda exchange_seconds, local, period: (
    exchange_seconds, "an exchange per update; never waits for stragglers"))


def register(cls: type, costs: StrategyCosts) -> None:
    """Prices strategy class `cls` (and its subclasses without an entry of their own) by `costs`."""
    TABLE[cls] = costs


def _entry(strategy) -> StrategyCosts | None:
    cls = strategy if isinstance(strategy, type) else type(strategy)
    return next((TABLE[c] for c in cls.__mro__ if c in TABLE), None)


def costs_of(strategy) -> StrategyCosts:
    """The entry of a strategy (an instance or its class): its class's, its nearest base's, else `DEFAULT`."""
    return _entry(strategy) or DEFAULT


def assumption(strategy) -> str | None:
    """What the cost model assumes of a strategy the table does not know (None: it knows it)."""
    if _entry(strategy) is not None:
        return None
    return (f"strategy {strategy.name!r} is not in jaxpar.cost.strategy_costs: priced like sync (every step variant "
            f"averages a gradient-sized tree over the replica axis once per step), each variant weighted by its "
            f"share of the plan's first {SAMPLED_STEPS:,} steps")


def variant_shares(strategy, ctx=None) -> dict:
    """{variant: its share of a long run's steps} (None: a fixed number of steps at the start); `ctx` (the
    trainer's `StepContext`) is needed only for a strategy the table does not know."""
    return costs_of(strategy).shares(strategy, ctx)


def theory(strategy, variant: str, gradient_bytes: int) -> list[Expected]:
    """The exchanges over the replica axis that `variant`'s step should contain (empty: a local step)."""
    return costs_of(strategy).theory(strategy, variant, gradient_bytes)


def project(cls: type, exchange_seconds: float, local: float, period: int) -> tuple[float, str]:
    """(mean seconds per step, how) of strategy class `cls` from another run's exchanging and local step times;
    `period`: that run's steps between exchanges over the replica axis."""
    return costs_of(cls).project(exchange_seconds, local, period)


def period(strategy) -> int:
    """Steps between a strategy's exchanges over the replica axis (1 for every strategy but local SGD / DiLoCo)."""
    return costs_of(strategy).period(strategy)


def periodic(cls: type) -> bool:
    """Whether a strategy class's replicas meet every H steps (local SGD, DiLoCo)."""
    return costs_of(cls).periodic
