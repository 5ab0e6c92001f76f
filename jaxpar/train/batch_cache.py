"""What a Trainer remembers of the batches it stepped on: a batch's check, placement and compilation signature are
decided once per structure (keys, array types, shapes, dtypes, the sharding of placed arrays), so a later batch of
the same structure costs a dictionary lookup (docs/benchmarks.md, host overhead).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.train.batches import BatchPlacer, indivisible_accum


def shape_signature(batch) -> tuple:
    """What one compilation of a step serves of a placed batch: each key's shape and dtype."""
    return tuple((k, tuple(v.shape), str(v.dtype)) for k, v in batch.items())


def structure(batch):
    """A batch's structure, cheap to build: a tuple of (key, array type, shape, dtype, sharding of a placed array);
    None for anything but a dict of numpy / jax arrays (checked every call)."""
    if type(batch) is not dict:
        return None
    shapes = []
    for key, value in batch.items():
        kind = type(value)
        if kind is np.ndarray:
            shapes.append((key, kind, value.shape, value.dtype, None))
        elif isinstance(value, jax.Array):
            shapes.append((key, kind, value.shape, value.dtype, value.sharding))
        else:
            return None
    return tuple(shapes)


class KnownBatches:
    """Checks and places a trainer's batches (`BatchPlacer`), each structure checked once."""

    def __init__(self, placer: BatchPlacer, replicas: int, grad_accum: int):
        self._placer, self._replicas, self._accum = placer, replicas, grad_accum
        self._known: dict = {}  # structure -> (rows, shape signature, already placed?)

    def prepare(self, batch) -> tuple[dict, int, tuple]:
        """(the batch placed on the mesh, its rows, its shape signature); a bad batch raises as `BatchPlacer.check`
        does, and rows that `grad_accum` does not divide per replica raise `ConfigError`."""
        shapes = structure(batch)
        known = self._known.get(shapes) if shapes is not None else None
        if known is not None:
            rows, signature, in_place = known
            return (batch if in_place else self._placer.place(batch)), rows, signature
        checked, rows = self._placer.check(batch)
        problem = indivisible_accum(rows, self._replicas, self._accum)
        if problem:
            raise ConfigError(problem)
        placed = self._placer.place(checked)
        signature = shape_signature(placed)
        if shapes is not None:  # arrays already on the batch sharding need no placement next time either
            self._known[shapes] = (rows, signature, all(placed[k] is v for k, v in batch.items()))
        return placed, rows, signature
