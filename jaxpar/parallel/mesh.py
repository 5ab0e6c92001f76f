"""The ONE module that names mesh axes and says what each is for; mesh specs -> `jax.sharding.Mesh`.

Axes, outermost to innermost (the device grid is laid out in this order, so `model` gets the closest devices and
`data` is the axis that crosses hosts first, then `stage`):

- `data`: data parallelism; the replica axis of local SGD / DiLoCo / SSP / ASP (a replica = one data group);
- `stage`: pipeline parallelism: the layers of a stacked block (the logical name `layers`) are split over it, one
  contiguous run of layers per stage, and activations go from stage to stage with `ppermute` over it. Its traffic is
  one activation per microbatch and tick, so it may cross hosts; the batch is not split over it;
- `fsdp`: ZeRO-3 / FSDP: the batch is split over it *and* parameters and optimizer state are sharded over it;
- `seq`: context parallelism: each example's sequence is split over it inside the model (`jaxpar.attention`);
  parameters are not split over it; gradients are averaged over it as over a batch axis. Inside fsdp, outside
  model: its K/V traffic every layer outweighs fsdp's weight gathers at long sequences, model's is heavier still;
- `model`: Megatron-style tensor parallelism.

Every other module asks for axes by role (`BATCH_AXES`, `GRADIENT_AXES`, `SEQ_AXIS`, ...), never by name. A model
written for explicit sharding names its own axes (`make_mesh("fsdp=4,tp=2", roles={"tp": "model"},
axis_types="explicit")`): the mesh keeps one axis per role in the order above; `axis_name(mesh, role)` gives its name.

Specs: `"8"` (data), `"2x4"` (data x model), `"2x2x2"` (data x fsdp x model), or named with any subset,
`"data=2,fsdp=2,model=2"`, `"fsdp=8"`, `"stage=4"`, `"data=2,stage=2,model=2"`, `"data=2,seq=4"`; absent axes have
size 1; `-1` once means all remaining devices. The positional forms never name `stage` or `seq`: ask for them by name.

    >>> mesh = make_mesh("data=2,stage=2,model=2")    # doctest: +SKIP
    >>> dict(mesh.shape)                              # doctest: +SKIP
    {'data': 2, 'stage': 2, 'fsdp': 1, 'seq': 1, 'model': 2}
"""

from __future__ import annotations

import math
import re

from jax.sharding import Mesh

from jaxpar.checks import is_int
from jaxpar.errors import MeshError
from jaxpar.parallel.device_grid import crossing_positions, device_grid
# (in_mesh and tracing: asked as mesh_lib.in_mesh / mesh_lib.tracing across the library)
from jaxpar.parallel.explicit_mesh import AUTO, AXIS_TYPES, EXPLICIT, in_mesh, is_explicit, tracing  # noqa: F401
from jaxpar.runtime.cpu_devices import how_to_get_cpu_devices, started_devices

DATA, STAGE, FSDP, SEQ, MODEL = "data", "stage", "fsdp", "seq", "model"
AXES = (DATA, STAGE, FSDP, SEQ, MODEL)  # outermost to innermost: stages may cross hosts, tensor parallelism never does

# Roles. Each is a tuple of axis names in mesh order (or one name).
BATCH_AXES = (DATA, FSDP)  # the global batch's leading dimension is split over these
GRADIENT_AXES = (DATA, FSDP, SEQ)  # gradients are averaged over these (by the compiler under Sync())
PARAMETER_AXES = (FSDP, MODEL)  # parameters and optimizer state are sharded over these by the rules
REPLICA_AXIS = DATA  # the worker of the non-sync strategies; inside a replica the other axes stay automatic
FSDP_AXIS = FSDP  # placement-only sharding (no change to the math): falls back to another dimension, or whole
TENSOR_AXIS = MODEL  # tensor parallelism: a rule that does not divide is an error
SEQ_AXIS = SEQ  # context parallelism: an example's sequence (the dimension after the examples) is split over it
STAGE_AXIS = STAGE  # pipeline stages: a stacked block's layers are split over it (a rule that does not divide is an
#                     error), stage-to-stage activations and cotangents are ppermute'd over it
WITHIN_REPLICA_AXES = tuple(a for a in AXES if a != REPLICA_AXIS)  # stage, fsdp, seq, model: inside a replica

# "AxB" / "AxBxC" positional forms name these axes, in order.
_POSITIONAL = {1: (DATA,), 2: (DATA, MODEL), 3: (DATA, FSDP, MODEL)}
_FORMS = ("'8' (data), '2x4' (data x model), '2x2x2' (data x fsdp x model) or named, e.g. "
          "'data=2,fsdp=2,model=2', 'fsdp=8', 'stage=4' or 'data=2,seq=4'; -1 in one place means all remaining devices")


def parse_mesh_spec(spec: str, roles: dict[str, str] | None = None) -> tuple[int, ...]:
    """Sizes of `AXES` (i.e. of the roles) in order; -1 stands for "all remaining devices" and is resolved by
    `resolve_shape`. `roles` (checked by `check_roles`): the model's own axis names, each playing one role."""
    text = str(spec).strip().replace(" ", "")
    roles = roles or {}
    sizes: dict[str, int] = {}
    given: dict[str, str] = {}  # role -> the axis name that gave its size
    if "=" in text:
        for part in text.split(","):
            name, _, value = part.partition("=")
            if name not in AXES and name not in roles:
                own = f" or the roles' names {', '.join(roles)}" if roles else (
                    "; an axis of the model's own name needs roles={name: role}")
                raise MeshError(f"--mesh {spec!r}: unknown axis {name!r}; axes are {', '.join(AXES)}{own} ({_FORMS})")
            role = roles.get(name, name)
            if role in sizes:
                other = "given twice" if given[role] == name else f"plays role {role!r}, as {given[role]!r} does"
                raise MeshError(f"--mesh {spec!r}: axis {name!r} {other} ({_FORMS})")
            sizes[role], given[role] = _parse_size(spec, value), name
    else:
        parts = text.lower().split("x")
        if len(parts) not in _POSITIONAL:
            raise MeshError(f"--mesh {spec!r}: {len(parts)} axes given but the short form has at most "
                            f"{max(_POSITIONAL)}; the axes {', '.join(AXES)} can all be given by name ({_FORMS})")
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
    """The named spec of a shape (sizes of `AXES`): (2, 1, 1, 1, 4) -> 'data=2,model=4' (axes of size 1 left out)."""
    named = [f"{axis}={size}" for axis, size in zip(AXES, shape) if size != 1]
    return ",".join(named) or f"{DATA}=1"


def resolve_shape(shape: tuple[int, ...], num_devices: int, spec: str = "", *, library: bool = False,
                  cpu_hint: bool = False) -> tuple[int, ...]:
    """Replaces a -1 by the number of remaining devices and checks the mesh fits `num_devices`.

    Messages name the spec as the CLI flag `--mesh` (`library=True`: `spec` is the repr of make_mesh's argument and
    messages name the call `make_mesh(...)`). `cpu_hint`: the devices are CPU devices JAX created before the mesh
    was asked for, so the message says how to get more.
    """
    shape = tuple(shape)
    spec = spec or format_shape(shape)
    subject = f"make_mesh({spec})" if library else f"--mesh {spec!r}"

    def fix(suggested: str) -> str:
        return f"make_mesh({suggested!r})" if library else f"--mesh {suggested}"

    if -1 in shape:
        fixed = math.prod(s for s in shape if s != -1)
        if num_devices % fixed:
            raise MeshError(f"{subject}: {num_devices} devices do not divide by {fixed}; "
                            f"try {fix(_suggest(shape, num_devices))}")
        shape = tuple(num_devices // fixed if s == -1 else s for s in shape)
    needed = math.prod(shape)
    if needed > num_devices:
        raise MeshError(f"{subject} needs {needed} devices but only {num_devices} are available; "
                        f"try {fix(_suggest(shape, num_devices))}{how_to_get_cpu_devices(needed) if cpu_hint else ''}")
    return shape


def _suggest(shape: tuple[int, ...], num_devices: int) -> str:
    """A spec that fits: from the innermost axis out (model, fsdp, stage), each inner axis as large as asked but
    dividing the devices left; `data` takes the rest. The short "AxB" form when only data and model remain."""
    left, sizes = num_devices, {}
    for axis, asked in reversed(list(zip(AXES[1:], shape[1:]))):
        asked = left if asked == -1 else asked
        sizes[axis] = max(d for d in range(1, min(asked, left) + 1) if left % d == 0)
        left //= sizes[axis]
    if sizes.get(FSDP, 1) == 1 and sizes.get(STAGE, 1) == 1 and sizes.get(SEQ, 1) == 1:
        return f"{left}x{sizes.get(MODEL, 1)}"
    return format_shape(tuple([left] + [sizes[axis] for axis in AXES[1:]]))


def check_roles(roles) -> dict[str, str]:
    """`roles` as a dict {the model's axis name: jaxpar role}; each mistake is one MeshError line."""
    if roles is None:
        return {}
    if not isinstance(roles, dict) or not all(isinstance(k, str) and k for k in roles):
        raise MeshError(f"roles {roles!r}: give a dict mapping your axis names to jaxpar roles "
                        f"({', '.join(AXES)}), e.g. roles={{'tp': '{MODEL}'}}")
    seen: dict[str, str] = {}
    for name, role in roles.items():
        if role not in AXES:
            raise MeshError(f"roles: axis {name!r} -> unknown role {role!r}; roles are {', '.join(AXES)}")
        if name in AXES and name != role:
            raise MeshError(f"roles: axis {name!r} -> {role!r}: {name!r} is jaxpar's name for the {name} role; "
                            f"give the {role} axis another name")
        if role in seen:
            raise MeshError(f"roles: axes {seen[role]!r} and {name!r} both play role {role!r}; one axis per role")
        seen[role] = name
    return dict(roles)


def axis_names_for(roles: dict[str, str]) -> tuple[str, ...]:
    """The mesh's axis names in role order (`AXES`): the model's own name where `roles` gives one, else jaxpar's."""
    own = {role: name for name, role in roles.items()}
    return tuple(own.get(role, role) for role in AXES)


def make_mesh(spec: str | int | tuple[int, ...] = "-1", devices=None, *, roles: dict[str, str] | None = None,
              axis_types: str = AUTO) -> Mesh:
    """Builds the (data, stage, fsdp, seq, model) mesh from a spec; a mesh smaller than the device list uses the first
    devices.

    `spec`: a string (see the module docstring); an int `n`, the same as the string `"n"` (data = n); or a tuple
    of sizes, where 1 size is (data,), 2 are (data, model) and 3 are (data, fsdp, model), like the "AxB" forms (a
    stage axis is asked for by name: `make_mesh("data=2,stage=2,model=2")`).
    Sizes are positive integers, or -1 once for all remaining devices. Every axis is `AxisType.Auto`: the compiler
    partitions what a sharding does not pin down (GSPMD style), which is what `NamedSharding` parameters and
    `shard_map(axis_names={REPLICA_AXIS})` expect.

    On CPU it asks JAX for the devices the mesh needs if it runs first; more than JAX started with is a MeshError.

    Models written for JAX's explicit sharding (jax-ml/bonsai's) name their own axes: `roles` maps each such name
    to the jaxpar role it plays (`make_mesh("fsdp=4,tp=2", roles={"tp": "model"}, axis_types="explicit")`); the
    mesh keeps one axis per role in jaxpar's order, named by the model where it says so. `axis_types`: "auto"
    (above) or "explicit" (`AxisType.Explicit`: shardings are part of the arrays' types, as such models expect;
    the Trainer then traces under `jax.set_mesh`).
    """
    roles = check_roles(roles)
    if axis_types not in AXIS_TYPES:
        raise MeshError(f"axis_types {axis_types!r}: give {AUTO!r} (the compiler partitions what shardings leave "
                        f"open) or {EXPLICIT!r} (shardings in the arrays' types, for models written with "
                        f"out_sharding=P(...))")
    library = not isinstance(spec, str)
    shape = _tuple_shape(spec) if library else parse_mesh_spec(spec, roles)
    cpu_hint = False
    if devices is None:
        devices, cpu_hint = started_devices(None if -1 in shape else math.prod(shape))
    shape = resolve_shape(shape, len(devices), repr(spec) if library else spec, library=library, cpu_hint=cpu_hint)
    grid = device_grid(shape, devices, repr(spec) if library else spec, library=library)
    return Mesh(grid, axis_names_for(roles), axis_types=(AXIS_TYPES[axis_types],) * len(AXES))


def crossing_axes(mesh: Mesh) -> list[str]:
    """The axes whose groups span more than one process (their collectives cross hosts)."""
    return [AXES[position] for position in crossing_positions(mesh.devices)]


_TUPLE_FORMS = ("give an int (data), a tuple of 1 to 3 sizes ((data,), (data, model) or (data, fsdp, model)) of "
                "positive integers with -1 at most once for all remaining devices, or a string like '2x4' (a stage "
                "axis only by name: 'data=2,stage=2,model=2')")


def _tuple_shape(spec) -> tuple[int, ...]:
    """Sizes of `AXES` from an int or a tuple spec (-1 kept, for `resolve_shape`)."""
    try:
        sizes = (spec,) if is_int(spec) else tuple(spec)
    except TypeError:
        raise MeshError(f"make_mesh({spec!r}): not a mesh spec; {_TUPLE_FORMS}") from None
    if len(sizes) not in _POSITIONAL:
        raise MeshError(f"make_mesh({spec!r}): {len(sizes)} sizes; {_TUPLE_FORMS}")
    for value in sizes:
        if not is_int(value):
            raise MeshError(f"make_mesh({spec!r}): size {value!r} is not an integer; {_TUPLE_FORMS}")
        if value < 1 and value != -1:
            raise MeshError(f"make_mesh({spec!r}): size {value} must be >= 1 (or -1 once); {_TUPLE_FORMS}")
    if list(sizes).count(-1) > 1:
        raise MeshError(f"make_mesh({spec!r}): -1 may appear only once; {_TUPLE_FORMS}")
    named = dict(zip(_POSITIONAL[len(sizes)], (int(v) for v in sizes)))
    return tuple(named.get(axis, 1) for axis in AXES)


def check_mesh(mesh) -> None:
    """Refuses a mesh jaxpar cannot use: anything but a `Mesh` as `make_mesh` builds it: one axis per role in the
    order of `AXES` (data, stage, fsdp, seq, model), each named by jaxpar or by `roles` (a name of jaxpar's only for its
    own role), all of them Auto or all Explicit."""
    fix = f"build it with jaxpar.make_mesh (axes {', '.join(AXES)}, e.g. jaxpar.make_mesh('2x4'))"
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh {mesh!r}: not a jax.sharding.Mesh; {fix}")
    names = tuple(mesh.axis_names)
    if len(names) != len(AXES) or any(n in AXES and n != role for n, role in zip(names, AXES)):
        raise MeshError(f"mesh with axes {names}: jaxpar needs a mesh from jaxpar.make_mesh with axes "
                        f"{', '.join(AXES)} (or your own names for them, make_mesh(..., roles={{'tp': '{MODEL}'}})); "
                        f"{fix}")
    if len(set(mesh.axis_types)) != 1 or mesh.axis_types[0] not in AXIS_TYPES.values():
        raise MeshError(f"mesh with axis types {tuple(str(t) for t in mesh.axis_types)}: jaxpar needs all axes "
                        f"AxisType.Auto or all AxisType.Explicit (make_mesh(..., axis_types='explicit')); {fix}")


# --- questions asked by role ---------------------------------------------------------------------------------------
# The axis playing a role is the mesh's axis at that role's place in `AXES` (make_mesh and check_mesh keep that
# order); on a mesh from `make_mesh(..., roles=...)` role names are translated by `axis_name` where a sharding is built.
def axis_name(mesh, axis: str) -> str:
    """The mesh's name for a role (one of `AXES`); a name the mesh has, or any other string, unchanged."""
    names = tuple(mesh.axis_names)
    if axis in names or axis not in AXES or len(names) != len(AXES):
        return axis
    return names[AXES.index(axis)]


def axis_names(mesh, axes) -> tuple[str, ...]:
    """`axis_name` of one axis or role, or of each in a tuple of them."""
    return tuple(axis_name(mesh, a) for a in ((axes,) if isinstance(axes, str) else axes))


def own_names(mesh) -> bool:
    """True when the mesh is not one of today's: its axes carry the model's own names, or they are Explicit."""
    return tuple(mesh.axis_names) != AXES or is_explicit(mesh)


def size(mesh: Mesh, axes) -> int:
    """Devices along one axis name (or role) or a tuple of them (1 for axes the mesh lacks)."""
    return math.prod(mesh.shape.get(a, 1) for a in axis_names(mesh, axes))


def replica_count(mesh: Mesh) -> int:
    return size(mesh, REPLICA_AXIS)


def seq_ways(mesh: Mesh) -> int:  # how many ways each example's sequence is split (context parallelism)
    return size(mesh, SEQ_AXIS)


def batch_ways(mesh: Mesh) -> int:
    """How many ways the global batch is split: the global batch must divide by this."""
    return size(mesh, BATCH_AXES)


def shape_line(mesh: Mesh) -> str:
    """'data=2 x stage=1 x fsdp=1 x seq=1 x model=4' for progress output (every axis, sizes of 1 included)."""
    return " x ".join(f"{axis}={mesh.shape[axis]}" for axis in mesh.axis_names)
