"""Items built ahead of their consumer in one background thread, a bounded number at a time.

`ReadAhead(make, cursor, depth)` calls `make(cursor) -> (item, next cursor)` again and again in a daemon thread,
with at most `depth` items built or being built that the consumer has not taken. `next()` returns (item, the cursor
after it) in order. The consumer's position is the cursor after the last item it took, never the producer's: `make`
must be a pure function of the cursor (a batch of `jaxpar.io.data.Batches` is one of its (position, step)), so
restarting at a cursor rebuilds exactly what would have come.

An exception raised by `make` (a data error: a file that shrank or cannot be read) is handed to the consumer in
place of the item it was building, and raised by the `next()` that would have returned that item: it surfaces at
the step it belongs to, as if the item had been built in the consumer's thread. The producer then stops.

`close()` stops the thread and joins it (also on garbage collection, and on leaving `with`); nothing is left
running after it. The thread holds no reference to its owner, only to `make`.

Why a thread, not worker processes: a batch is numpy gathers and positioned reads (`os.pread`), which run in
well under a millisecond per batch of 512 and release the GIL for the reads; a worker process would add a pickle
and a copy of every batch, more than the build itself (see docs/data.md for the measurement).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

POLL_SECONDS = 0.05  # how often a blocked producer or consumer checks whether it was stopped


class ReadAhead:
    def __init__(self, make: Callable[[Any], tuple[Any, Any]], cursor, depth: int = 2, name: str = "jaxpar-read-ahead"):
        if depth < 1:
            raise ValueError(f"depth {depth}: must be at least 1")
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(depth)  # one per item not yet taken, taken before building it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_produce, args=(make, cursor, self._queue, self._slots, self._stop),
                                        name=name, daemon=True)
        self._thread.start()
        self._failed = None

    def next(self) -> tuple[Any, Any]:
        """(the next item, the cursor after it); raises the error that building it raised."""
        if self._failed is not None:
            raise self._failed
        while True:
            try:
                item, after, error = self._queue.get(timeout=POLL_SECONDS)
                self._slots.release()
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("read-ahead thread stopped") from None
        if error is not None:
            self._failed = error
            self.close()
            raise error
        return item, after

    def close(self) -> None:
        """Stops the producer and waits for it to end (it ends within the build it is in, plus POLL_SECONDS)."""
        self._stop.set()
        self._thread.join()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


def _produce(make, cursor, items: queue.Queue, slots: threading.Semaphore, stop: threading.Event) -> None:
    while not stop.is_set():
        if not slots.acquire(timeout=POLL_SECONDS):
            continue  # `depth` items wait for the consumer
        try:
            item, after = make(cursor)
            items.put((item, after, None))
        except BaseException as error:  # noqa: B902 (handed to the consumer, raised there)
            items.put((None, cursor, error))
            return
        cursor = after
