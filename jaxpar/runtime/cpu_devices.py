"""CPU devices: how many XLA:CPU creates is a setting read once, when JAX starts its backends.

`jaxpar.make_mesh` asks for as many CPU devices as its mesh needs when it runs first (so that `--mesh 2x4` just
works on a laptop), unless the user already chose a count (`XLA_FLAGS=--xla_force_host_platform_device_count=N` or
`jax.config.update("jax_num_cpu_devices", N)`); `jaxpar.runtime.distributed` sets a process's local count the
same way. The setting affects only the CPU backend, so it is harmless on GPU / TPU machines.
"""

from __future__ import annotations

import os

import jax


def user_set_cpu_device_count() -> bool:
    """True when the user (or a test harness) already chose how many CPU devices XLA creates."""
    return ("xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
            or jax.config.jax_num_cpu_devices != -1)


def backend_started() -> bool:
    from jax._src import xla_bridge  # no public API answers "has JAX initialised its backends?"
    return xla_bridge.backends_are_initialized()


def ensure_cpu_devices(count: int) -> None:
    """Asks XLA for `count` CPU devices if JAX has not started yet and nobody chose a count.

    Harmless on GPU/TPU machines: the setting only affects the CPU backend.
    """
    if count > 1 and not backend_started() and not user_set_cpu_device_count():
        jax.config.update("jax_num_cpu_devices", count)


def started_devices(count: int | None):
    """(JAX's devices, whether they are CPU devices JAX had started with before this call), after asking for `count`
    CPU devices (None: not known yet) by `ensure_cpu_devices`. A mesh larger than such devices gets
    `how_to_get_cpu_devices` in its message."""
    started = backend_started()
    if count is not None:
        ensure_cpu_devices(count)
    devices = jax.devices()
    return devices, started and devices[0].platform == "cpu"


def how_to_get_cpu_devices(count: int) -> str:
    """The end of a message refusing a mesh larger than the CPU devices JAX already started with."""
    return (f"; or, for {count} CPU devices, set XLA_FLAGS=--xla_force_host_platform_device_count={count} or call "
            f"jax.config.update('jax_num_cpu_devices', {count}) before JAX starts (jaxpar.make_mesh does this itself "
            f"when it is the first to use JAX)")
