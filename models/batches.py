"""What a built-in model needs of a batch: each key's dtype and shape, checked with one line naming what was given.

The check runs where the loss runs: inside a jitted step it runs while JAX traces the step, so once per batch shape
and dtype, never per step; it reads only shapes and dtypes (no device-to-host copy).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import numpy as np

from jaxpar.errors import DataError


class BatchKey(NamedTuple):
    key: str
    kind: str  # "integer" | "floating"
    shape_ok: Callable  # (shape, model) -> bool
    shape_text: Callable  # model -> the shape it needs, e.g. "[B, L + 1] with 1 <= L <= seq_len 128"


def check_batch(name: str, batch, model, keys: tuple[BatchKey, ...]) -> None:
    """Raises `jaxpar.DataError` naming the first key of `batch` that model `name` cannot take."""
    if not hasattr(batch, "keys"):
        raise DataError(f"the {name} model needs a dict batch with {', '.join(repr(k.key) for k in keys)}; got "
                        f"{type(batch).__name__}")
    for spec in keys:
        try:
            needs, shape_ok = f"{spec.kind} {spec.shape_text(model)}", spec.shape_ok
        except AttributeError:  # another model with this loss: only the key and its dtype are known
            needs, shape_ok = f"{spec.kind} values", (lambda shape, model: True)
        if spec.key not in batch:
            raise DataError(f"batch has no {spec.key!r} key (it has {', '.join(map(repr, batch)) or 'none'}); the "
                            f"{name} model needs batch[{spec.key!r}]: {needs}")
        value = batch[spec.key]
        if not hasattr(value, "dtype"):  # a list: its dtype and shape as numpy reads them
            value = np.asarray(value)
        dtype, shape = np.dtype(value.dtype), tuple(value.shape)
        if not np.issubdtype(dtype, getattr(np, spec.kind)) or not shape_ok(shape, model):
            got = f"{dtype.name} [{', '.join(map(str, shape))}]"
            raise DataError(f"batch[{spec.key!r}]: got {got}; the {name} model needs {needs}")


def checked(name: str, loss: Callable, keys: tuple[BatchKey, ...]) -> Callable:
    """`loss` that first checks its batch against `keys` (same signature)."""
    @functools.wraps(loss)
    def checked_loss(model, batch, label_smoothing: float = 0.0):
        check_batch(name, batch, model, keys)
        return loss(model, batch, label_smoothing)

    return checked_loss
