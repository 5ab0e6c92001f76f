"""The pipeline flags (--pipeline, --microbatches, --repeats) against each other, the model, the batch and the stage
axis: each problem one `ConfigError` line naming the flag, the value and what would work, before anything is built.

The library checks the same facts when a step is first traced (`jaxpar.pipeline.Pipeline`, `Stack`); the CLI checks
them up front, in flags. A model with nothing to pipeline (the MLP, the CNN) on a mesh with stage > 1 is the
partitioner's one `ShardingError` line (no stacked layers), raised while the trainer is built.
"""

from __future__ import annotations

import models
from jaxpar.cli.options import shown
from jaxpar.errors import ConfigError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.pipeline.config import CIRCULAR, Pipeline


def pipeline_of(config) -> Pipeline:
    """The `jaxpar.pipeline.Pipeline` the (validated) config asks for."""
    return Pipeline(config.pipeline, config.microbatches, config.repeats)


def blocks_option(config) -> str | None:
    """The option counting the built-in model's stacked blocks (the transformer's `layers`, one
    `jaxpar.pipeline.Stack`), or None: a model with nothing to pipeline or microbatch."""
    return models.spec(config.model).blocks


def rounds(config) -> int:
    """Chunks of layers per stage: --repeats under --pipeline circular, else 1."""
    return config.repeats if config.pipeline == CIRCULAR else 1


def check_repeats(config) -> None:
    """--repeats is the circular schedule's only (like --lr-decay-steps is the step schedule's)."""
    if config.repeats > 1 and config.pipeline != CIRCULAR:
        raise ConfigError(f"--repeats {config.repeats} applies only to --pipeline {CIRCULAR} (got {config.pipeline}); "
                          f"add --pipeline {CIRCULAR}, or drop --repeats")


def spec_stages(config) -> int | None:
    """The stage-axis size the --mesh spec asks for (None: a -1 there, known once the mesh exists)."""
    stages = dict(zip(mesh_lib.AXES, mesh_lib.parse_mesh_spec(config.mesh)))[mesh_lib.STAGE_AXIS]
    return None if stages == -1 else stages


def check_stages(config, stages: int | None) -> None:
    """The stacked layers against a stage axis of `stages` (None: not known yet) and the schedule."""
    option = blocks_option(config)
    if not stages or stages == 1 or option is None:  # nothing pipelined; the MLP / CNN: the partitioner's line
        return
    layers, flag, repeats = getattr(config, option), shown(config, option), rounds(config)
    if layers % stages:
        fits = max(d for d in range(1, stages + 1) if layers % d == 0 and stages % d == 0)
        raise ConfigError(f"{flag} {layers} does not divide by the {mesh_lib.STAGE_AXIS} axis of size {stages} "
                          f"(--mesh {config.mesh}): each stage runs an equal run of layers; use a multiple of "
                          f"{stages} for {flag}, or a {mesh_lib.STAGE_AXIS} axis that divides {layers} (e.g. "
                          f"{mesh_lib.STAGE_AXIS}={fits})")
    if layers % (stages * repeats):
        fits = max(r for r in range(1, repeats + 1) if layers % (stages * r) == 0)
        raise ConfigError(f"--repeats {repeats}: {flag} {layers} does not split into {stages} stages x {repeats} "
                          f"repeats (--pipeline {CIRCULAR}, --mesh {config.mesh}); use a multiple of "
                          f"{stages * repeats} for {flag}, or --repeats {fits}")
    if repeats > 1 and config.microbatches < stages:
        raise ConfigError(f"--microbatches {config.microbatches} with --pipeline {CIRCULAR} --repeats {repeats} on "
                          f"{stages} stages: a round of microbatches must be back at stage 0 before it is due, so "
                          f"the circular schedule needs at least as many microbatches as stages; use --microbatches "
                          f"{stages} or more")


def indivisible_microbatches(config, size: int, replicas: int, flag: str) -> str | None:
    """The one line for --microbatches that does not divide each replica's rows of one (accumulation) microbatch of
    a global batch of `size` rows (None: it divides, or the model has nothing to microbatch).

    The stack cuts the batch it receives: the global batch / --grad-accum under a strategy whose step is one jit
    over the whole batch, one replica's batch / --grad-accum under the explicit strategies (inside a replica).
    Asking M to divide each replica's share covers both, and keeps every microbatch an equal share of every
    replica's rows (nothing moves between devices), as --grad-accum does."""
    if blocks_option(config) is None:
        return None
    count, accum = config.microbatches, config.grad_accum
    rows = size // replicas // accum
    if rows % count == 0:
        return None
    parts = f"{flag} {size}" + (f" / {replicas} replicas" if replicas > 1 else "") + (
        f" / --grad-accum {accum}" if accum > 1 else "")
    fits = max(d for d in range(1, min(count, rows) + 1) if rows % d == 0)
    return (f"--microbatches {count} does not divide the {rows} rows per replica that the stacked layers cut "
            f"({parts}); use a divisor of {rows}, e.g. --microbatches {fits}")
