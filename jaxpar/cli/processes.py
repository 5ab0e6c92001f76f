"""Joining the processes of a run over several processes / hosts (JAX's distributed runtime)."""

from __future__ import annotations

import math

from jaxpar.cli.config import Config
from jaxpar.errors import ConfigError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.runtime import distributed


def join_processes(config: Config) -> bool:
    """Starts JAX's distributed runtime when the config or the environment asks for several processes (see
    `jaxpar.runtime.distributed`); each process then creates mesh size / processes CPU devices. True if several."""
    shape = mesh_lib.parse_mesh_spec(config.mesh)
    given = (config.coordinator, config.num_processes, config.process_id)
    count = config.num_processes or distributed.settings_from_environment().get("num_processes")
    local = None
    if count and count > 1 and -1 not in shape:
        if math.prod(shape) % count:
            raise ConfigError(f"--mesh {config.mesh} has {math.prod(shape)} devices, which do not divide over "
                              f"--num-processes {count}; use a mesh whose size is a multiple of {count}")
        local = math.prod(shape) // count
    if any(value is not None for value in given):
        return distributed.initialize(*given, local_devices=local)
    return distributed.initialize(local_devices=local)
