"""A mesh's axis types (make_mesh's `axis_types`): whether its axes are `AxisType.Explicit`, and the context jaxpar
traces, initialises, steps and evaluates in on an Explicit mesh (`jax.set_mesh`, which cannot be entered inside
jit)."""

from __future__ import annotations

import contextlib

import jax
from jax.sharding import AxisType

AUTO, EXPLICIT = "auto", "explicit"  # make_mesh's axis_types
AXIS_TYPES = {AUTO: AxisType.Auto, EXPLICIT: AxisType.Explicit}


def is_explicit(mesh) -> bool:
    """True when the mesh's axes are `AxisType.Explicit`: tracing must then happen under `jax.set_mesh`."""
    return bool(mesh.axis_types) and all(t == AxisType.Explicit for t in mesh.axis_types)


def tracing(mesh):
    """The context jaxpar traces, initialises, steps and evaluates in: `jax.set_mesh(mesh)` on an Explicit mesh
    (partition specs inside the model need it, and it cannot be entered inside jit), nothing otherwise."""
    return jax.set_mesh(mesh) if is_explicit(mesh) else contextlib.nullcontext()


def in_mesh(jitted, mesh):
    """`jitted` as it is on an Auto mesh (nothing added to a step's dispatch); on an Explicit mesh, an `InMesh`."""
    return InMesh(jitted, mesh) if is_explicit(mesh) else jitted


class InMesh:
    """A jitted function called and lowered under `tracing(mesh)` (jit traces at its first call or `lower`)."""

    def __init__(self, jitted, mesh):
        self.jitted, self.mesh = jitted, mesh

    def __call__(self, *args, **kwargs):
        with tracing(self.mesh):
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with tracing(self.mesh):
            return self.jitted.lower(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        with tracing(self.mesh):
            return self.jitted.eval_shape(*args, **kwargs)
