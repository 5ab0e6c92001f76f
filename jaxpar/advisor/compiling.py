"""The advisor's meshes compiled: each built and lowered in turn while earlier ones compile in threads."""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

from jaxpar.errors import JaxparError


def compiled_meshes(specs, make_trainer: Callable, batch, workers: int | None) -> Iterator[tuple[str, object]]:
    """(spec, (its sync Trainer, {first variant: compiled step}) or the JaxparError that refused it) for each of
    `specs` in order, each as soon as it is compiled. The meshes are built and lowered here one after another
    (tracing is Python) while up to `workers` of them compile in threads: XLA compiles outside Python's lock, and
    compiling is most of a plan's time. Default 1: on the 2-core machine under load, 2 workers took the transformer's
    plan from 165.9 s to 188.0 s (and the MLP's from 41.0 to 34.0 s); `python -m benchmarks.plan_speed` compares
    them on a quiet machine."""
    workers = max(1, workers or 1)
    pending: collections.deque = collections.deque()

    def finished(entry):
        spec, trainer, variant, compiling = entry
        return spec, compiling if isinstance(compiling, JaxparError) else (trainer, {variant: compiling.result()})

    with ThreadPoolExecutor(workers) as threads:
        for spec in specs:
            try:
                trainer = make_trainer(spec)
                first = trainer.strategy.plan(trainer.ctx, 0)
                lowered = trainer.lowered_step(first.variant, batch, first.inputs)
                pending.append((spec, trainer, first.variant, threads.submit(lowered.compile)))
            except JaxparError as error:
                pending.append((spec, None, None, error))
            while len(pending) > workers:
                yield finished(pending.popleft())
        while pending:
            yield finished(pending.popleft())
