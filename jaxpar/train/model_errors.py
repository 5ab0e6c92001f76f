"""An exception raised inside the user's model or loss function, said as one `ModelCallError` line (or, raised by
the model factory, one `ModelError` line: `call_factory`).

At trace time (`call_user`, around every call of the loss) the exception becomes a `ModelCallError` that says what
was raised; the trainer, which knows the step and the global batch, says it again with both (`at_step`). The
original exception is `__cause__` throughout. `JaxparError`s (already one line), device errors and
`KeyboardInterrupt` pass unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import jax

from jaxpar.errors import JaxparError, ModelCallError, ModelError
from jaxpar.parallel import mesh as mesh_lib

_UNBOUND_AXIS = re.compile(r"unbound axis name: ([^\s.]+)")  # JAX's NameError for a collective over an unknown axis


def call_user(fn, *args):
    """`fn(*args)`; what it raises as a `ModelCallError` (see the module docstring)."""
    try:
        return fn(*args)
    except (JaxparError, jax.errors.JaxRuntimeError):
        raise
    except Exception as error:
        raise ModelCallError(describe(error)) from error


def call_factory(factory, rngs):
    """`factory(rngs)`, the user's model factory; what it raises as one `ModelError` naming the factory (the
    original as `__cause__`)."""
    try:
        return factory(rngs)
    except (JaxparError, jax.errors.JaxRuntimeError):
        raise
    except Exception as error:
        name = getattr(factory, "__name__", None) or type(factory).__name__
        lines = str(error).strip().splitlines()
        raise ModelError(f"model {name}: the factory raised {type(error).__name__}"
                         f"{': ' + lines[0] if lines else ''}; it must build the model, rngs -> nnx.Module") from error


def describe(error: Exception) -> str:
    """One line saying what the user's code raised, with the fix where one is known."""
    match = _UNBOUND_AXIS.search(str(error)) if isinstance(error, NameError) else None
    if match and match[1] in mesh_lib.AXES:
        return (f"the model uses jaxpar's mesh axis name {match[1]!r} in a collective; the mesh axes are bound only "
                f"inside the explicit strategies: give the model's collectives their own axis name (e.g. 'batch') "
                f"and pass batch_axis_names=('batch',) to jaxpar.Trainer")
    if match:
        name = match[1]
        return (f"the model uses the axis name {name!r} (a collective such as lax.pmean, or BatchNorm(axis_name="
                f"{name!r}) written for pmap), which nothing binds: pass batch_axis_names=({name!r},) to "
                f"jaxpar.Trainer (or jaxpar.from_linen) to bind it over the whole batch")
    lines = str(error).strip().splitlines()
    return f"the model or loss_fn raised {type(error).__name__}" + (f": {lines[0]}" if lines else "")


def batch_shapes(batch: Mapping) -> str:
    """`{x: (16, 8) float32, y: (16,) int32}`."""
    return "{" + ", ".join(f"{key}: {tuple(value.shape)} {value.dtype}" for key, value in batch.items()) + "}"


def at_step(error: ModelCallError, step: int, batch: Mapping, where: str = "step") -> ModelCallError:
    """`error` said again with the step and the batch's shapes; raise it `from error.__cause__`."""
    return ModelCallError(f"{where} {step}, batch {batch_shapes(batch)}: {error}")
