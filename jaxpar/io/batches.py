"""Endless, resumable global batches from a source: `Batches` (the index stream, this process's rows, batches read
ahead in a thread) and `prefetch_to_device` (the next batches' host-to-device copies in flight). The sources that
ship with jaxpar are in `jaxpar.io.data`; any object with `__len__` and `__getitem__(indices)` is one."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

import numpy as np

from jaxpar.errors import DataError
from jaxpar.io.index_stream import IndexStream
from jaxpar.io.read_ahead import ReadAhead


class ArraySource:
    """Examples are rows of equally long arrays."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def __getitem__(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[indices] for k, v in self.arrays.items()}



# --- batches -----------------------------------------------------------------------------------------------------
DEFAULT_READ_AHEAD = 2  # batches a training run builds ahead (run.py); the library's default builds none ahead


class _Draw:
    """cursor (position, step) -> (this process's rows of that global batch, the next cursor): a pure function, run
    in the read-ahead thread or inline. Holds no reference to its `Batches` (so a dropped one stops its thread)."""

    def __init__(self, source, stream: IndexStream, size_at, rows, place=None):
        self.source, self.stream, self.size_at, self.rows, self.place = source, stream, size_at, rows, place
        self._rows: dict[int, np.ndarray] = {}  # global size -> row positions (a pure function of the size)

    def __call__(self, cursor: tuple[int, int]):
        position, step = cursor
        size = self.size_at(step)
        if self.rows is None:
            indices = self.stream[np.arange(position, position + size)]
        else:
            rows = self._rows.get(size)
            if rows is None:
                rows = self._rows[size] = np.asarray(self.rows(size), np.int64)
            indices = self.stream[position + rows]
        batch = self.source[indices]
        return (batch if self.place is None else self.place(batch)), (position + size, step + 1)


class Batches(Iterator):
    """Endless global batches (this process's rows of them) from a source, in a seeded order.

    `source`: anything with `__len__` and `__getitem__(indices: int64 array) -> dict of arrays` (or a dict of equally
    long arrays). `batch_size` is an int or a function step -> int (a batch-size ramp). Every epoch is a fresh
    permutation (`jaxpar.io.index_stream`); a batch may straddle two epochs, so no example is dropped or repeated
    within an epoch. `rows`: global batch size -> the row positions this process loads (`Trainer.local_rows`); None
    loads every row (one process). `read_ahead`: how many batches a background thread builds ahead
    (`jaxpar.io.read_ahead`; 0 builds each in `next`). The state (`get_state`) is always that of the next batch
    `next` returns, whatever was built ahead; `close()` (or `with`) stops the thread.
    """

    def __init__(self, source, batch_size: int | Callable[[int], int], seed: int, name: str = "dataset",
                 shuffle: bool = True, largest_batch: int | None = None,
                 rows: Callable[[int], np.ndarray] | None = None, read_ahead: int = 0):
        source = ArraySource(source) if isinstance(source, dict) else source
        self.source, self.name, self.read_ahead = source, name, read_ahead
        self._size_at = batch_size if callable(batch_size) else (lambda step: batch_size)
        largest = largest_batch or self._size_at(0)
        if len(source) < largest:
            raise DataError(f"{name} has {len(source)} examples, fewer than one global batch of {largest}; "
                            f"use a global batch (--batch-size / --batch-ramp) of {len(source)} or less")
        self._stream = IndexStream(len(source), seed, shuffle)
        self._reader: ReadAhead | None = None
        self._draw = _Draw(source, self._stream, self._size_at, rows)
        self._cursor = (0, 0)

    @property
    def rows(self):
        return self._draw.rows

    @rows.setter
    def rows(self, rows) -> None:
        self.close()
        self._draw = _Draw(self.source, self._stream, self._size_at, rows, self._draw.place)

    @property
    def place(self):
        """None, or a function applied to each batch where it is built (`prefetch_to_device` sets it to its `put`
        when batches are read ahead, so the host-to-device copies start in the read-ahead thread)."""
        return self._draw.place

    @place.setter
    def place(self, place) -> None:
        self.close()
        self._draw = _Draw(self.source, self._stream, self._size_at, self._draw.rows, place)

    @property
    def position(self) -> int:
        return self._cursor[0]

    @property
    def step(self) -> int:
        return self._cursor[1]

    def get_state(self) -> dict:
        return {"position": self._cursor[0], "step": self._cursor[1]}

    def set_state(self, state: dict) -> None:
        self.close()
        self._cursor = (int(state["position"]), int(state["step"]))

    def __next__(self) -> dict[str, np.ndarray]:
        if self.read_ahead <= 0:
            batch, self._cursor = self._draw(self._cursor)
            return batch
        if self._reader is None:
            self._reader = ReadAhead(self._draw, self._cursor, self.read_ahead, name=f"jaxpar-read-ahead:{self.name}")
        batch, self._cursor = self._reader.next()
        return batch

    def close(self) -> None:
        """Stops the read-ahead thread (if any) and waits for it; `next` starts a new one at the same position."""
        reader, self._reader = getattr(self, "_reader", None), None
        if reader is not None:
            reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


class prefetch_to_device(Iterator):
    """Keeps `size` batches already placed on the devices (`put` is e.g. `trainer.shard_batch`): transfers are
    asynchronous in JAX, so the next batches' copies overlap the running step; with `Batches` that read ahead, `put`
    runs in their thread as each batch is built (`Batches.place`). `get_state` is the state of the
    next batch to be consumed, not of the last one fetched. An error drawing a batch is raised by the `next` that
    would have returned that batch (the batches before it are still returned). `close()` closes `batches`."""

    def __init__(self, batches: Batches, put: Callable, size: int = 2):
        self.batches, self.put, self.size = batches, put, size
        if isinstance(batches, Batches) and batches.read_ahead > 0 and batches.place is None:
            batches.place, self.put = put, (lambda batch: batch)  # placed in the read-ahead thread
        self._queue = collections.deque()
        self._error: BaseException | None = None

    def _fill(self):
        while len(self._queue) < self.size and self._error is None:
            state = self.batches.get_state()
            try:
                batch = next(self.batches)
            except Exception as error:  # raised when its turn comes
                self._error = error
                break
            self._queue.append((state, self.put(batch)))

    def __next__(self):
        self._fill()
        if not self._queue:
            error, self._error = self._error, None
            raise error
        return self._queue.popleft()[1]

    def get_state(self) -> dict:
        return self._queue[0][0] if self._queue else self.batches.get_state()

    def set_state(self, state: dict) -> None:
        self._queue.clear()
        self._error = None
        self.batches.set_state(state)

    def close(self) -> None:
        self._queue.clear()
        getattr(self.batches, "close", lambda: None)()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
