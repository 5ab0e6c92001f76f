"""Stopping on request: SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) finishes the current step, saves a
checkpoint, waits until it is durable and exits 0 (`run.py` with `--checkpoint-dir`). A second Ctrl-C stops at
once; repeated SIGTERMs (schedulers send several) do not interrupt the save.

Several processes must stop after the same step (saving is a collective act): there JAX's preemption sync manager
(started by `jax.distributed.initialize`) takes SIGTERM in whichever process gets it and `at(step)` turns true on
every process at the same step. A Ctrl-C in one process is turned into a SIGTERM to itself, so it is agreed too.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import jax



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

    def at(self, step: int) -> bool:
        """Stop after `step`? Called once per step, on every process (several processes agree on the step)."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.is_set()

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            if jax.process_count() > 1:  # SIGTERM belongs to JAX's preemption notifier (see the module docstring)
                self._previous = {signal.SIGINT: signal.signal(signal.SIGINT, self._interrupt_all)}
            else:
                self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _interrupt_all(self, number, frame) -> None:
        if self.requested.is_set():
            self.__exit__()
            raise KeyboardInterrupt()
        self.requested.set()
        print("jaxpar: SIGINT received: all processes save a checkpoint after an agreed step, then stop (Ctrl-C "
              "again to stop at once)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

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
