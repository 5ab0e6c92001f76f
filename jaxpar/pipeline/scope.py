"""What a `Stack` sees while a step is traced: the mesh and `Pipeline` of the trainer tracing it, and, for 1F1B's
split of the loss, whether to record the stack's input or to stand in for its output.

The trainer sets it inside the function it jits (so it holds exactly while that function is traced); a Stack
called anywhere else runs as a plain scan over its layers.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field
from typing import Any

from jaxpar.pipeline.config import Pipeline

RUN, CAPTURE, REPLACE = "run", "capture", "replace"


@dataclass
class Scope:
    mesh: Any = None
    pipeline: Pipeline = field(default_factory=Pipeline)
    mode: str = RUN
    record: dict = field(default_factory=dict)  # CAPTURE: what the stack was called with
    output: Any = None  # REPLACE: what the stack returns
    remat: Any = None  # the trainer's remat policy (`jaxpar.train.remat`), applied per layer; None: no remat


_SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("jaxpar_pipeline_scope", default=None)


def current() -> Scope | None:
    return _SCOPE.get()


@contextlib.contextmanager
def using(scope: Scope):
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def within(mesh, pipeline: Pipeline | None, fn, remat=None):
    """`fn` with the scope (mesh, pipeline, remat policy) set while it runs (i.e. while jit traces it)."""
    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        with using(Scope(mesh, pipeline or Pipeline(), remat=remat)):
            return fn(*args, **kwargs)

    return scoped
