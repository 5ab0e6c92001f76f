"""Ray itself: imported only when the runtime is used, started quietly (a local instance by default, or an existing
cluster's address), and the environment each actor process starts with (its CPU device count, this jaxpar)."""

from __future__ import annotations

import logging
import os
import re
import socket
import sys

from jaxpar.errors import ConfigError, OptionError

INSTALL = "pip install 'jaxpar[ray]'"
CONNECT_TIMEOUT_S = 10.0  # an unreachable --ray-address is said within this (and well within 30 s)
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S+")


def ray_module():
    """`ray`, or a ConfigError naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"the ray runtime needs Ray, which is not installed; {INSTALL}") from None
    return ray


def check_address(address: str) -> None:
    """A HOST:PORT address must answer within CONNECT_TIMEOUT_S (Ray itself would wait far longer)."""
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise OptionError("ray_address", address, "expected HOST:PORT of a Ray head (ray start --head prints it, "
                          "e.g. 10.0.0.1:6379), or 'auto'")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise OptionError("ray_address", address, f"nothing answers there within {CONNECT_TIMEOUT_S:g} s "
                          f"({error.strerror or type(error).__name__}); start the head with `ray start --head` on "
                          f"that machine, or leave {{ray_address}} out for a local Ray instance") from None


def start(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Starts or joins Ray unless this process already did; True when this call started it (the caller then shuts
    it down). Ray's own log lines stay out of the terminal."""
    ray = ray_module()
    if ray.is_initialized():
        return False
    if address:
        check_address(address)
    # a local instance starts no idle worker processes for the first driver: every jaxpar actor has its own
    # runtime_env (its device count), so none of them could use one (measured: ray.init 5.8 -> 3.4 s, 3 s of CPU less)
    local = {} if address else {"_system_config": {"prestart_worker_first_driver": False}}
    ray.init(address=address, num_cpus=None if address else num_cpus, log_to_driver=False,
             logging_level=logging.ERROR, include_dashboard=False, configure_logging=True, **local)
    return True


def actor_env(cpu_devices: int) -> dict:
    """The runtime_env of an actor process: this jaxpar first on its path, then this process's import path (so a
    worker on this machine imports the user's modules as the driver does: their model, loss and batches functions
    travel by reference); `cpu_devices` CPU devices (set before the process imports JAX; harmless on GPU
    machines). On other machines the same paths must hold the same code (docs/processes.md)."""
    import jaxpar

    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxpar.__file__)))
    flags = _DEVICE_COUNT.sub("", os.environ.get("XLA_FLAGS", "")).strip()
    flags = f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
    entries = [root] + [os.path.abspath(p or os.curdir) for p in sys.path]
    path = os.pathsep.join(dict.fromkeys(p for p in entries if os.path.isdir(p)))
    return {"env_vars": {"XLA_FLAGS": flags, "PYTHONPATH": path}}
