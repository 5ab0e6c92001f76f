"""--context-parallel and the seq axis against the model, --seq-len and --heads: each problem one `ConfigError`
line before anything is built (the library checks the same facts when a step is traced, `jaxpar.attention`)."""

from __future__ import annotations

import models
from jaxpar.errors import ConfigError
from jaxpar.parallel import context as cp
from jaxpar.parallel import mesh as mesh_lib


def context_of(config) -> cp.ContextParallel:
    """The `Trainer(context_parallel=...)` the config asks for (the mesh is bound by the trainer)."""
    return cp.ContextParallel(config.context_parallel or cp.DEFAULT)


def spec_seq(config) -> int | None:
    """The seq-axis size --mesh asks for (None: a -1 there, known once the mesh exists)."""
    ways = dict(zip(mesh_lib.AXES, mesh_lib.parse_mesh_spec(config.mesh)))[mesh_lib.SEQ_AXIS]
    return None if ways == -1 else ways


def check_context(config, ways: int | None) -> None:
    """The seq axis of size `ways` (None: not known yet) against the model, --seq-len, --heads and
    --context-parallel."""
    if ways is None:
        return
    seq = f"--mesh {config.mesh} ({mesh_lib.SEQ_AXIS}={ways})"
    if ways == 1:
        if config.context_parallel not in (None, cp.DEFAULT):
            raise ConfigError(f"--context-parallel {config.context_parallel}: the mesh --mesh {config.mesh} has no "
                              f"{mesh_lib.SEQ_AXIS} axis to split the sequence over; add one (e.g. --mesh "
                              f"data=2,{mesh_lib.SEQ_AXIS}=4) or drop --context-parallel")
        return
    if models.spec(config.model).blocks is None:  # the MLP, the CNN: no sequence, no attention
        raise ConfigError(f"{seq}: --model {config.model} has no sequence to split (context parallelism needs a "
                          f"model whose attention calls jaxpar.attention, e.g. --model transformer); use a mesh "
                          f"without {mesh_lib.SEQ_AXIS}")
    settings = context_of(config)
    cp.check_length(config.seq_len, ways, settings.zigzag and settings.algorithm == cp.RING)
    cp.check_heads(config.heads, ways, settings.algorithm)


def context_notes(config) -> list[str]:
    ways = spec_seq(config)
    if ways == 1 and config.context_parallel == cp.DEFAULT:
        return [f"--context-parallel {cp.DEFAULT} without a {mesh_lib.SEQ_AXIS} axis in --mesh {config.mesh}: "
                f"the sequence is not split, attention runs whole on every device"]
    return []
