"""The ONE module that names mesh axes and says what each is for; mesh specs -> `jax.sharding.Mesh`.

Axes, outermost to innermost (the device grid is laid out in this order, so `model` gets the closest devices and
`data` is the axis that crosses hosts first):

- `data`: data parallelism; the replica axis of local SGD / DiLoCo / SSP / ASP (a replica = one data group);
- `fsdp`: ZeRO-3 / FSDP: the batch is split over it *and* parameters and optimizer state are sharded over it;
- `model`: Megatron-style tensor parallelism.

Every other module asks for axes by role (`BATCH_AXES`, `GRADIENT_AXES`, `PARAMETER_AXES`, `REPLICA_AXIS`, ...) and
never spells an axis name, so a later axis (pipeline stages) slots in by adding it and its roles here.

Specs: `"8"` (data), `"2x4"` (data x model), `"2x2x2"` (data x fsdp x model), or named with any subset,
`"data=2,fsdp=2,model=2"`, `"fsdp=8"`; absent axes have size 1; `-1` once means all remaining devices.

On a CPU-only machine the number of devices is a start-up setting of XLA. `make_mesh` provides it (unless the
user already chose a count, or JAX has already started) so that `--mesh 2x4` just works on a laptop.

    >>> mesh = make_mesh("data=2,fsdp=2,model=2")     # doctest: +SKIP
    >>> dict(mesh.shape)                              # doctest: +SKIP
    {'data': 2, 'fsdp': 2, 'model': 2}
"""

from __future__ import annotations

import math
import os
import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxpar.errors import MeshError

DATA, FSDP, MODEL = "data", "fsdp", "model"
AXES = (DATA, FSDP, MODEL)  # outermost to innermost

# Roles. Each is a tuple of axis names in mesh order (or one name).
BATCH_AXES = (DATA, FSDP)  # the global batch's leading dimension is split over these
GRADIENT_AXES = (DATA, FSDP)  # gradients are averaged over these (by the compiler under Sync())
PARAMETER_AXES = (FSDP, MODEL)  # parameters and optimizer state are sharded over these by the rules
REPLICA_AXIS = DATA  # the worker of the non-sync strategies; inside a replica the other axes stay automatic
FSDP_AXIS = FSDP  # placement-only sharding (no change to the math): falls back to another dimension, or whole
TENSOR_AXIS = MODEL  # tensor parallelism: a rule that does not divide is an error
WITHIN_REPLICA_AXES = tuple(a for a in AXES if a != REPLICA_AXIS)

# "AxB" / "AxBxC" positional forms name these axes, in order.
_POSITIONAL = {1: (DATA,), 2: (DATA, MODEL), 3: (DATA, FSDP, MODEL)}
_FORMS = ("'8' (data), '2x4' (data x model), '2x2x2' (data x fsdp x model) or named, e.g. "
          "'data=2,fsdp=2,model=2' or 'fsdp=8'; -1 in one place means all remaining devices")


def parse_mesh_spec(spec: str) -> tuple[int, ...]:
    """Sizes of `AXES` in order; -1 stands for "all remaining devices" and is resolved by `resolve_shape`."""
    text = str(spec).strip().replace(" ", "")
    sizes: dict[str, int] = {}
    if "=" in text:
        for part in text.split(","):
            name, _, value = part.partition("=")
            if name not in AXES:
                raise MeshError(f"--mesh {spec!r}: unknown axis {name!r}; axes are {', '.join(AXES)} ({_FORMS})")
            if name in sizes:
                raise MeshError(f"--mesh {spec!r}: axis {name!r} given twice ({_FORMS})")
            sizes[name] = _parse_size(spec, value)
    else:
        parts = text.lower().split("x")
        if len(parts) not in _POSITIONAL:
            raise MeshError(f"--mesh {spec!r}: {len(parts)} axes given but a mesh has at most {len(AXES)}, "
                            f"{', '.join(AXES)} ({_FORMS})")
        sizes = dict(zip(_POSITIONAL[len(parts)], (_parse_size(spec, p) for p in parts)))
    shape = tuple(sizes.get(axis, 1) for axis in AXES)
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


def format_shape(shape) -> str:
    """The named spec of a shape: (2, 1, 4) -> 'data=2,model=4' (axes of size 1 left out)."""
    named = [f"{axis}={size}" for axis, size in zip(AXES, shape) if size != 1]
    return ",".join(named) or f"{DATA}=1"


def resolve_shape(shape: tuple[int, ...], num_devices: int, spec: str = "") -> tuple[int, ...]:
    """Replaces a -1 by the number of remaining devices and checks the mesh fits `num_devices`."""
    shape = tuple(shape)
    spec = spec or format_shape(shape)
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


def _suggest(shape: tuple[int, ...], num_devices: int) -> str:
    """A spec that fits: from the innermost axis out, each inner axis as large as asked but dividing the devices
    left; `data` takes the rest."""
    left, sizes = num_devices, {}
    for axis, asked in reversed(list(zip(AXES[1:], shape[1:]))):
        asked = left if asked == -1 else asked
        sizes[axis] = max(d for d in range(1, min(asked, left) + 1) if left % d == 0)
        left //= sizes[axis]
    if sizes.get(FSDP, 1) == 1:
        return f"{left}x{sizes.get(MODEL, 1)}"
    return format_shape(tuple([left] + [sizes[axis] for axis in AXES[1:]]))


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


def make_mesh(spec: str | tuple[int, ...] = "-1", devices=None) -> Mesh:
    """Builds the (data, fsdp, model) mesh from a spec; a mesh smaller than the device list uses the first devices.

    A tuple spec of 2 is (data, model) and of 3 is (data, fsdp, model), like the "AxB" forms. Every axis is
    `AxisType.Auto`: the compiler partitions what a sharding does not pin down (GSPMD style), which is what
    `NamedSharding` parameters and `shard_map(axis_names={REPLICA_AXIS})` expect.
    """
    if isinstance(spec, str):
        shape, text = parse_mesh_spec(spec), spec
    else:
        sizes = tuple(spec)
        if len(sizes) not in _POSITIONAL:
            raise MeshError(f"mesh shape {sizes!r}: give 1 to {len(AXES)} sizes ({_FORMS})")
        named = dict(zip(_POSITIONAL[len(sizes)], sizes))
        shape, text = tuple(named.get(axis, 1) for axis in AXES), "x".join(map(str, sizes))
    if devices is None:
        if -1 not in shape:
            ensure_cpu_devices(math.prod(shape))
        devices = jax.devices()
    shape = resolve_shape(shape, len(devices), text)
    grid = np.asarray(devices[: math.prod(shape)], dtype=object).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


# --- questions asked by role ---------------------------------------------------------------------------------------
def size(mesh: Mesh, axes) -> int:
    """Devices along one axis name or a tuple of them (1 for axes the mesh lacks)."""
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(mesh.shape.get(a, 1) for a in names)


def replica_count(mesh: Mesh) -> int:
    return size(mesh, REPLICA_AXIS)


def batch_ways(mesh: Mesh) -> int:
    """How many ways the global batch is split: the global batch must divide by this."""
    return size(mesh, BATCH_AXES)


def shape_line(mesh: Mesh) -> str:
    """'data=2 x fsdp=1 x model=4' for progress output."""
    return " x ".join(f"{axis}={mesh.shape[axis]}" for axis in AXES)


def batch_spec(leading=()) -> P:
    """Examples over the batch axes; `leading` unsplit dimensions in front (e.g. a microbatch axis)."""
    return P(*leading, BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, batch_spec())


def replica_spec(*rest) -> P:
    """Leading dimension = one entry per replica, over the replica axis; `rest` for the other dimensions."""
    return P(REPLICA_AXIS, *rest)


def replica_batch_spec() -> P:
    """Inside a replica (manual over the replica axis only) the batch's rows are split over the replica axis."""
    return P(REPLICA_AXIS)


def keep_within_replica(spec: P) -> P:
    """`spec` with every axis but the within-replica ones dropped: the spec of one replica's shard for a
    shard_map manual over the within-replica axes (what a device holds of a parameter inside its replica)."""
    def keep(entry):
        if entry is None:
            return None
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(a for a in names if a in WITHIN_REPLICA_AXES)
        return kept[0] if len(kept) == 1 else (kept or None)

    return P(*(keep(e) for e in spec))
