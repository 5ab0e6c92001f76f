"""--runtime: where a run's replicas live. `emulated` (the default): one SPMD program, asynchrony emulated exactly
on a simulated clock. `ray`: each index of the data axis a Ray actor process with a parameter server
(`jaxpar.runtime.ray`). What each option means under the ray runtime, and the checks of a ray run's config."""

from __future__ import annotations

from jaxpar.cli.options import shown
from jaxpar.errors import ConfigError
from jaxpar.parallel.mesh import parse_mesh_spec
from jaxpar.strategies import BN_LOCAL

RUNTIMES = ("emulated", "ray")
RAY = "ray"
RAY_ONLY = ("ray_address", "max_restarts", "server_shards")  # options that apply only with --runtime ray
# options a ray run cannot honour -> the values that mean "not used"
RAY_UNSUPPORTED = {"allreduce": (None,), "torus": (None,), "compress": (None, "none"), "local_after": (None, 0),
                   "hardware": (None,), "profile": (None,), "batch_ramp": (None,),
                   "coordinator": (None,), "num_processes": (None,), "process_id": (None,), "plan": (False,),
                   "eval_every": (0,), "bn": (None, BN_LOCAL)}


def check_runtime(config) -> None:
    """One ConfigError line for an option that does not fit the config's runtime."""
    if config.runtime != RAY:
        for name in RAY_ONLY:
            if getattr(config, name) is not None:
                raise ConfigError(f"{shown(config, name)} {getattr(config, name)!r}: applies only with --runtime "
                                  f"ray; add --runtime ray, or drop it")
        return
    for name, unused in RAY_UNSUPPORTED.items():
        value = getattr(config, name)
        if value not in unused:
            raise ConfigError(f"{shown(config, name)} {value!r}: not supported with --runtime ray; drop it, or use "
                              f"--runtime emulated")
    shape = parse_mesh_spec(config.mesh)
    if -1 in shape:
        raise ConfigError(f"--mesh {config.mesh}: give every axis's size with --runtime ray (no -1: each worker "
                          f"process makes its own devices), e.g. --mesh data=4")
    if shape[0] < 2:
        raise ConfigError(f"--mesh {config.mesh}: the data axis is {shape[0]}, and --runtime ray runs one worker "
                          f"process per index of the data axis; use data=2 or more, e.g. --mesh data=4")
