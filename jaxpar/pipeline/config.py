"""`Pipeline`: how a model's `Stack` runs over the stage axis (schedule, microbatches, repeats), and its checks.

The schedule facts every reader asks (the bubble, the stage traffic per tick, the activation memory) live here.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpar.checks import check_int
from jaxpar.errors import ConfigError

GPIPE, CIRCULAR, ONE_F_ONE_B = "gpipe", "circular", "1f1b"
SCHEDULES = (GPIPE, CIRCULAR, ONE_F_ONE_B)


@dataclass(frozen=True)
class Pipeline:
    """How a `jaxpar.pipeline.Stack` runs on a mesh with a stage axis.

    schedule: "gpipe" (autodiff through the forward ticks; activation memory grows with M), "circular" (`repeats`
      chunks of layers per stage, a smaller bubble) or "1f1b" (a forward and a backward alternate on every stage;
      at most S stage inputs kept per device whatever M).
    microbatches: M, the pieces the batch is cut into (rows m, m + M, ... form microbatch m, like gradient
      accumulation). Part of the model's math when dropout is on: the stack draws its masks per microbatch, on
      every mesh, so set it the same on every mesh you compare.
    repeats: R, chunks of layers per stage under "circular" (1 otherwise).
    """

    schedule: str = GPIPE
    microbatches: int = 1
    repeats: int = 1

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"Pipeline(schedule={self.schedule!r}): choose one of {', '.join(SCHEDULES)}")
        check_int("Pipeline(microbatches=...)", self.microbatches, 1, "the pieces each batch is cut into")
        check_int("Pipeline(repeats=...)", self.repeats, 1, "chunks of layers per stage")
        if self.repeats > 1 and self.schedule != CIRCULAR:
            raise ConfigError(f"Pipeline(repeats={self.repeats}) applies to schedule='circular' only (this one is "
                              f"{self.schedule!r}); use repeats=1 or schedule='circular'")

    @property
    def rounds(self) -> int:
        """Chunks of layers each stage holds (R under circular, else 1)."""
        return self.repeats if self.schedule == CIRCULAR else 1

    def ticks(self, stages: int) -> int:
        """Ticks of the forward (GPipe, circular: one chunk each; the backward has as many) or of the whole step
        (1F1B: each tick a forward half-step and a backward half-step on every stage): R M + S - 1."""
        return self.rounds * self.microbatches + stages - 1

    def bubble(self, stages: int) -> float:
        """The fraction of ticks in which a stage computes nothing useful: (S - 1) / (R M + S - 1)."""
        return (stages - 1) / (self.rounds * self.microbatches + stages - 1)

    def check_layers(self, layers: int, stages: int, where: str = "Stack") -> None:
        """Layers must split into stages x rounds equal runs."""
        runs = stages * self.rounds
        if layers % runs:
            what = f"{stages} stages x {self.rounds} repeats" if self.rounds > 1 else f"{stages} stages"
            raise ConfigError(f"{where}: {layers} layers do not split into {what}; use a layer count divisible by "
                              f"{runs}, or another stage count or --repeats")

    def check_microbatches(self, rows: int, stages: int, where: str = "batch", shards: int = 1) -> None:
        """`shards`: the data shards each microbatch's rows are split over inside the stages."""
        if rows % self.microbatches:
            raise ConfigError(f"{where} of {rows} rows does not split into --microbatches {self.microbatches} "
                              f"(Pipeline(microbatches={self.microbatches})); use a microbatch count that divides "
                              f"{rows}")
        if (rows // self.microbatches) % shards:
            raise ConfigError(f"{where} of {rows} rows in --microbatches {self.microbatches} (Pipeline(microbatches="
                              f"{self.microbatches})) gives microbatches of {rows // self.microbatches} rows, which "
                              f"do not split over the {shards} data shards; use a batch divisible by "
                              f"{self.microbatches * shards}, or fewer microbatches")
        if self.schedule == CIRCULAR and self.rounds > 1 and self.microbatches < stages:
            raise ConfigError(f"--pipeline circular with --microbatches {self.microbatches} on {stages} stages "
                              f"(Pipeline('circular', microbatches={self.microbatches})): the circular schedule needs "
                              f"at least as many microbatches as stages; use --microbatches {stages} or more")
