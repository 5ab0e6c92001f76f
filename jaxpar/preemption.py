"""Stopping on request: SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) finishes the current step, saves a
checkpoint, waits until it is durable and exits 0 (`run.py` with `--checkpoint-dir`). A second Ctrl-C stops at
once; repeated SIGTERMs (schedulers send several) do not interrupt the save.
"""

from __future__ import annotations

import signal
import sys
import threading



class StopRequest:
    """While active (`with StopRequest() as stop:`), SIGTERM and SIGINT set `stop.requested` instead of killing;
    `actions.StopWhen(stop.is_set, checkpoint)` then saves and stops after the step in flight. Only the main thread
    can take signals: elsewhere this does nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = threading.Event()
        self.signal: int | None = None
        self._previous: dict = {}

    def is_set(self) -> bool:
        return self.requested.is_set()

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _handle(self, number, frame) -> None:
        if self.requested.is_set():
            if number == signal.SIGINT:  # a second Ctrl-C: stop now, as without checkpoints
                self.__exit__()
                raise KeyboardInterrupt()
            return  # schedulers repeat SIGTERM: keep saving (the checkpoint must become durable)
        self.requested.set()
        self.signal = number
        print(f"jaxpar: {signal.Signals(number).name} received: saving a checkpoint after the step in flight, then "
              f"stopping (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
