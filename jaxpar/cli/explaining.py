"""`run.py --explain`: the plan, memory, collectives and FLOPs of a built run's step variants; nothing trains and
nothing is written."""

from __future__ import annotations

import jax

import models
from jaxpar.cli.build import Built
from jaxpar.cli.config import Config
from jaxpar.runtime import distributed


def explain_run(config: Config, built: Built) -> dict:
    """Prints (process 0) and returns {"explain": report} for the first batch's shape."""
    from jaxpar.cost.explain import explain, format_explain

    trainer = built.trainer
    rows = next(iter(built.train_batches))  # this process's rows: the step is compiled for the global batch's shape
    batch = {k: jax.ShapeDtypeStruct((trainer.global_rows(len(v)),) + v.shape[1:], v.dtype) for k, v in rows.items()}
    blocks = models.spec(config.model).blocks  # the option counting the stacked blocks
    report = explain(trainer, batch, blocks=getattr(config, blocks) if blocks else None, fit=True)
    if distributed.is_main():
        print(format_explain(report), flush=True)
    return {"explain": report}
