"""The global batch sizes of a run, checked against the devices the batch is split over (`indivisible_batch`'s one
message), --grad-accum and --microbatches."""

from __future__ import annotations

from jaxpar.cli.pipelining import indivisible_microbatches
from jaxpar.errors import ConfigError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.train.batches import indivisible_accum, indivisible_batch
from jaxpar.train.lr_schedules import parse_batch_ramp


def batch_sizes(config, ways: int, replicas: int) -> list[int]:
    """Every global batch size the run will use (ramp stages that start at or after --steps never run and are not
    checked), checked against the batch axes, --grad-accum and --microbatches."""
    if config.batch_ramp:
        sizes = [size for start, size in parse_batch_ramp(config.batch_ramp, ways, config.steps)
                 if start < config.steps]
        flag = "--batch-ramp"
    else:
        sizes, flag = [config.batch_size], "--batch-size"
    for size in sizes:
        problem = indivisible_batch(size, ways, flag, config.mesh)
        if problem:
            raise ConfigError(problem)
        problem = indivisible_accum(size, replicas, config.grad_accum, flag)
        if problem:
            raise ConfigError(problem)
        problem = indivisible_microbatches(config, size, replicas, flag)
        if problem:
            raise ConfigError(problem)
    return sizes


def static_batch_sizes(config) -> None:
    """`batch_sizes` from the --mesh spec alone, before any device exists (nothing to do with a -1 in it)."""
    shape = dict(zip(mesh_lib.AXES, mesh_lib.parse_mesh_spec(config.mesh)))
    if -1 not in shape.values():
        ways = 1
        for axis in mesh_lib.BATCH_AXES:
            ways *= shape[axis]
        batch_sizes(config, ways, shape[mesh_lib.REPLICA_AXIS])
