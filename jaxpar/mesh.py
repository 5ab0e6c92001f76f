"""Mesh specs ("8", "2x4", "data=2,model=4") -> `jax.sharding.Mesh` with axes ("data", "model").

On a CPU-only machine the number of devices is a start-up setting of XLA. `make_mesh` provides it (unless the
user already chose a count, or JAX has already started) so that `--mesh 2x4` just works on a laptop.

    >>> mesh = make_mesh("2x4")        # doctest: +SKIP
    >>> dict(mesh.shape)               # doctest: +SKIP
    {'data': 2, 'model': 4}
"""

from __future__ import annotations

import math
import os
import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar.errors import MeshError

AXES = ("data", "model")
_FORMS = "'8' (data only), '2x4' (data x model) or 'data=2,model=4'; -1 in one place means all remaining devices"


def parse_mesh_spec(spec: str) -> tuple[int, int]:
    """Returns (data, model) sizes; -1 stands for "all remaining devices" and is resolved by `resolve_shape`."""
    text = str(spec).strip().replace(" ", "")
    if "=" in text:
        sizes = {}
        for part in text.split(","):
            name, _, value = part.partition("=")
            if name not in AXES:
                raise MeshError(f"--mesh {spec!r}: unknown axis {name!r}; axes are 'data' and 'model' ({_FORMS})")
            if name in sizes:
                raise MeshError(f"--mesh {spec!r}: axis {name!r} given twice ({_FORMS})")
            sizes[name] = _parse_size(spec, value)
        shape = (sizes.get("data", 1), sizes.get("model", 1))
    else:
        parts = text.lower().split("x")
        if len(parts) > 2:
            raise MeshError(f"--mesh {spec!r}: {len(parts)} axes given but a mesh has at most 2, data and model ({_FORMS})")
        shape = tuple(_parse_size(spec, p) for p in parts)
        shape = shape if len(shape) == 2 else (shape[0], 1)
    if shape.count(-1) > 1:
        raise MeshError(f"--mesh {spec!r}: -1 may appear only once ({_FORMS})")
    return shape


def _parse_size(spec: str, value: str) -> int:
    if not re.fullmatch(r"-1|[0-9]+", value):
        raise MeshError(f"--mesh {spec!r}: {value!r} is not an axis size ({_FORMS})")
    size = int(value)
    if size == 0:
        raise MeshError(f"--mesh {spec!r}: axis sizes must be >= 1 ({_FORMS})")
    return size


def resolve_shape(shape: tuple[int, int], num_devices: int, spec: str = "") -> tuple[int, int]:
    """Replaces a -1 by the number of remaining devices and checks the mesh fits `num_devices`."""
    spec = spec or "x".join(map(str, shape))
    if -1 in shape:
        fixed = math.prod(s for s in shape if s != -1)
        if num_devices % fixed:
            raise MeshError(f"--mesh {spec!r}: {num_devices} devices do not divide by {fixed}; "
                            f"try --mesh {_suggest(shape, num_devices)}")
        shape = tuple(num_devices // fixed if s == -1 else s for s in shape)
    needed = math.prod(shape)
    if needed > num_devices:
        raise MeshError(f"--mesh {spec!r} needs {needed} devices but only {num_devices} are available; "
                        f"try --mesh {_suggest(shape, num_devices)}")
    return shape


def _suggest(shape: tuple[int, int], num_devices: int) -> str:
    model = shape[1] if shape[1] != -1 and shape[1] <= num_devices and num_devices % shape[1] == 0 else 1
    return f"{num_devices // model}x{model}"


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


def make_mesh(spec: str | tuple[int, int] = "-1", devices=None) -> Mesh:
    """Builds the ("data", "model") mesh from a spec; a mesh smaller than the device list uses the first devices.

    Both axes are `AxisType.Auto`: the compiler partitions everything a sharding does not pin down (GSPMD style),
    which is what tensor parallelism through `NamedSharding` and `shard_map(axis_names={"data"})` expect.
    """
    shape = parse_mesh_spec(spec) if isinstance(spec, str) else tuple(spec)
    if devices is None:
        if -1 not in shape:
            ensure_cpu_devices(math.prod(shape))
        devices = jax.devices()
    shape = resolve_shape(shape, len(devices), spec if isinstance(spec, str) else "")
    grid = np.asarray(devices[: math.prod(shape)], dtype=object).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))

