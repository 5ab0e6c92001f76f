"""Host batches onto the mesh: checks once per batch, this process's rows of a global batch, placement.

A global batch is a dict of arrays with a common leading example dimension, split over the batch axes. With one
process every row is placed from the host; with several, each process holds only its distinct row blocks of every
global batch (`local_rows`), and host arrays given to a process are its rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from jaxpar.errors import DataError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd


def indivisible_batch(size: int, ways: int, flag: str | None = None, mesh: str | None = None) -> str | None:
    """The one line for a global batch of `size` rows that does not divide over the `ways` devices of the batch axes
    (None: it divides). `flag` names the setting (e.g. "--batch-size"; None: "global batch size"), `mesh` the
    --mesh it was given with."""
    if size % ways == 0:
        return None
    axes = " x ".join(mesh_lib.BATCH_AXES)
    where = f"{axes} of --mesh {mesh}" if mesh else axes
    good = max(ways, size // ways * ways)
    return (f"{flag or 'global batch size'} {size} does not divide by the {ways} devices the batch is split over "
            f"({where}); use a multiple of {ways}, e.g. {f'{flag} ' if flag else ''}{good}")


def indivisible_accum(size: int, replicas: int, accum: int, flag: str | None = None) -> str | None:
    """The one line for gradient accumulation whose microbatch count does not divide each replica's share of a
    global batch of `size` rows (None: it divides). `flag` names the batch setting ("--batch-size"; None: the
    library's `grad_accum` and "global")."""
    per_replica = size // replicas
    if per_replica % accum == 0:
        return None
    name = "--grad-accum" if flag else "grad_accum"
    return (f"{name} {accum} does not divide the per-replica batch {per_replica} ({flag or 'global'} {size} / "
            f"{replicas} replicas); use a divisor of {per_replica}")


class BatchPlacer:
    """Checks and places global batches for one mesh (the batch sharding is `shd.batch_sharding(mesh)`)."""

    def __init__(self, mesh):
        self.sharding = shd.batch_sharding(mesh)
        self.ways = mesh_lib.batch_ways(mesh)
        # this process's share of a global batch: its distinct row blocks of the `ways` the batch is split into
        self.local_blocks = len(self._block_starts(self.ways))

    def local_rows(self, global_size: int) -> np.ndarray:
        """The rows of a global batch of `global_size` rows that this process loads (all rows in one process),
        in increasing order: from the batch sharding's addressable indices, so any device order is right."""
        problem = indivisible_batch(global_size, self.ways)
        if problem:
            raise DataError(problem)
        per_block = global_size // self.ways
        return np.concatenate([np.arange(start, start + per_block) for start in self._block_starts(global_size)])

    def _block_starts(self, global_size: int) -> list[int]:
        """First rows of the blocks of a global batch this process's devices hold (the addressable indices)."""
        blocks = self.sharding.addressable_devices_indices_map((global_size,)).values()
        return sorted({index[0].start or 0 for index in blocks})

    def global_rows(self, local_size: int) -> int:
        """The global batch size of which `local_size` rows are this process's share."""
        return local_size * self.ways // self.local_blocks

    def check(self, batch) -> tuple[dict, int]:
        """(the batch as a dict of arrays, its number of global rows); nested lists of numbers become numpy
        arrays. Every problem is a `DataError` naming the key or the size."""
        if not isinstance(batch, Mapping) or not batch:
            raise DataError(f"batch: got {type(batch).__name__}{' (empty)' if isinstance(batch, Mapping) else ''}; "
                            f"a batch is a dict of arrays with a common leading example dimension")
        arrays = {}
        for key, value in batch.items():
            if not isinstance(value, (jax.Array, np.ndarray)):
                try:
                    value = np.asarray(value)
                except (TypeError, ValueError):
                    value = None
            if value is None or np.dtype(value.dtype).kind not in "biufc":
                raise DataError(f"batch[{key!r}]: {type(batch[key]).__name__} is not a numeric array (ragged "
                                f"lists or non-numbers); pass numpy arrays with a leading example dimension")
            arrays[key] = value
        sizes = {k: v.shape[0] if v.ndim else None for k, v in arrays.items()}
        if None in sizes.values() or len(set(sizes.values())) != 1:
            raise DataError(f"batch arrays must share a leading example dimension; got leading sizes {sizes}")
        size = next(iter(sizes.values()))
        if any(not isinstance(v, jax.Array) for v in arrays.values()) and self.local_blocks != self.ways:
            # several processes: host arrays are this process's rows (`local_rows`) of the global batch
            if size % self.local_blocks:
                raise DataError(f"process {jax.process_index()} was given {size} rows, which do not divide over "
                                f"its {self.local_blocks} blocks of the global batch; give each process "
                                f"trainer.local_rows(global batch size) of every global batch")
            size = self.global_rows(size)
        if size == 0:
            raise DataError(f"batch has 0 rows; a global batch needs a positive multiple of {self.ways} rows "
                            f"({' x '.join(mesh_lib.BATCH_AXES)} = {self.ways} devices)")
        problem = indivisible_batch(size, self.ways)
        if problem:
            raise DataError(problem)
        return arrays, size

    def place(self, batch: dict) -> dict[str, jax.Array]:
        """Every array on the mesh, examples split over the batch axes (placed arrays are left as they are)."""
        return {k: v if isinstance(v, jax.Array) and v.sharding == self.sharding else self._place(v)
                for k, v in batch.items()}

    def abstract(self, batch: Mapping) -> dict:
        """`jax.ShapeDtypeStruct`s of a global batch (arrays or shapes), placed by the batch sharding."""
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.sharding)
                for k, v in ((k, v if hasattr(v, "dtype") else np.asarray(v)) for k, v in batch.items())}

    def _place(self, rows):
        if self.local_blocks == self.ways:  # this process holds every row block
            return jax.device_put(rows, self.sharding)
        # several processes: each holds only its rows of the global batch (`local_rows`)
        rows = np.asarray(rows)
        return jax.make_array_from_process_local_data(
            self.sharding, rows, (self.global_rows(len(rows)),) + rows.shape[1:])
