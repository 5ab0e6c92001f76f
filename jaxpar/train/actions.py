"""Periodic host actions that `Trainer.fit` runs when a step's metrics are ready: logging, evaluation, your own.

An action is any object with `every` (steps between calls; 0 = only at the end), `at_end` (also after the last
step of the `fit` call), `needs_state` (it reads the train state: `fit` then runs it before the next step is
dispatched, since that step donates the state) and `__call__(event)`. `fit` calls it with a `StepEvent`. Two
optional hooks: `dispatching(step)` (asked before step `step` is dispatched; a context manager returned is entered
around the dispatch) and `finish()` (called once when `fit` ends, however it ends).

    class PrintLoss(jaxpar.Action):
        every = 100
        def __call__(self, event):
            print(event.step, event.metrics["loss"])

    state = trainer.fit(state, batches, steps=1000, actions=[PrintLoss(), jaxpar.train.actions.Evaluate(fn, every=500)])
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple


class StepEvent(NamedTuple):
    step: int  # updates applied so far (1 after the first step)
    metrics: dict  # that step's metrics as host floats
    state: Any  # the train state after that step (None unless the action `needs_state`)
    trainer: Any  # the Trainer running `fit`
    last: bool  # the last step of this `fit` call


class Action:
    """Base class; subclasses set `every` / `at_end` / `needs_state` and implement `__call__`."""

    every: int = 1
    at_end: bool = False
    needs_state: bool = False

    def due(self, step: int, last: bool) -> bool:
        return bool(self.every and step % self.every == 0) or (self.at_end and last)

    def __call__(self, event: StepEvent) -> None:
        raise NotImplementedError

    def dispatching(self, step: int):
        """Before step `step` (1 = the first update) is dispatched: None, or a context manager entered around it."""
        return None

    def finish(self) -> None:
        """When `fit` ends: after its last step, or on its way out with an error."""

    @property
    def label(self) -> str:
        return type(self).__name__


class OnStep(Action):
    """Calls `fn(step, metrics)` after every step (the `on_step=` argument of `fit`)."""

    def __init__(self, fn: Callable[[int, dict], None]):
        self.fn = fn

    def __call__(self, event):
        self.fn(event.step, event.metrics)

    @property
    def label(self) -> str:
        return getattr(self.fn, "__name__", "on_step")


class Log(Action):
    """Progress lines and JSONL records through a `jaxpar.io.metrics.RunLogger` (which picks the steps it prints)."""

    def __init__(self, logger):
        self.logger = logger

    def __call__(self, event):
        self.logger.on_step(event.step, event.metrics)


class Evaluate(Action):
    """Every `every` steps (and at the end, unless `at_end=False`): `results = evaluate(trainer, state)` (a dict of
    floats), then `on_result(step, results)`."""

    needs_state = True

    def __init__(self, evaluate: Callable, every: int = 0, on_result: Callable[[int, dict], None] | None = None,
                 at_end: bool = True):
        self.evaluate, self.every, self.on_result, self.at_end = evaluate, every, on_result, at_end
        self.history: list[tuple[int, dict]] = []

    def __call__(self, event):
        results = self.evaluate(event.trainer, event.state)
        self.history.append((event.step, results))
        if self.on_result is not None:
            self.on_result(event.step, results)


class StopIfDiverged(Action):
    """Ends training (a `TrainingDiverged` error) when the loss is not finite, or when it explodes: above
    `factor` x the first step's loss and above `floor` (defaults 100 x and 1e3: 2.3 -> 4.3e5 is divergence, while a
    loss that wanders up a few times over is not). `hint(loss, step)` words the advice.

    Steps the trainer skipped (metric `skipped`, see `Trainer(skip_nonfinite=True)`) are counted instead, into the
    metric `skipped_steps`; more than `max_skips` in a row end training (None: never).
    """

    def __init__(self, hint: Callable[[float, int], str] | None = None, factor: float = 100.0, floor: float = 1e3,
                 max_skips: int | None = None, max_skips_name: str = "max_skips"):
        self.hint, self.factor, self.floor, self.max_skips = hint, factor, floor, max_skips
        self.max_skips_name = max_skips_name  # how the message names the limit (run.py: --max-skips)
        self.first: float | None = None  # the first finite loss this action saw
        self.skipped = self.in_a_row = 0

    def get_state(self) -> dict:
        """The counters and the first loss, JSON-serialisable: saved with a checkpoint, so a resumed run goes on
        counting `skipped_steps` and comparing with the same first loss."""
        return {"skipped": self.skipped, "in_a_row": self.in_a_row, "first": self.first}

    def set_state(self, state: dict) -> None:
        self.skipped = int(state.get("skipped", self.skipped))
        self.in_a_row = int(state.get("in_a_row", self.in_a_row))
        self.first = state.get("first", self.first)

    def __call__(self, event):
        from jaxpar.errors import TrainingDiverged

        loss = event.metrics.get("loss", 0.0)
        if event.metrics.get("skipped"):
            # throughput counts applied examples only: none, or under a local SGD step the replicas that did not skip
            event.metrics["examples"] = event.metrics.get("examples", 0.0) * (1.0 - event.metrics["skipped"])
            self.skipped += 1
            self.in_a_row += 1
            event.metrics["skipped_steps"] = float(self.skipped)
            if self.max_skips is not None and self.in_a_row > self.max_skips:
                advice = self.hint(loss, event.step) if self.hint else "lower the learning rate"
                raise TrainingDiverged(f"training diverged: {self.in_a_row} steps in a row were skipped (loss {loss} "
                                       f"at step {event.step}), more than {self.max_skips_name} {self.max_skips}; the state is "
                                       f"that of step {event.step - self.in_a_row}; {advice}")
            return
        self.in_a_row = 0
        if self.skipped:
            event.metrics["skipped_steps"] = float(self.skipped)
        if event.metrics.get("nonfinite") and math.isfinite(loss):  # the loss was fine, the update was not
            advice = self.hint(loss, event.step) if self.hint else "lower the learning rate"
            raise TrainingDiverged(f"training diverged: the update of step {event.step} is not finite (its loss "
                                   f"{loss:.4g} was); {advice}")
        if self.first is None and math.isfinite(loss):
            self.first = loss
        exploded = (math.isfinite(loss) and self.first is not None and loss > self.floor
                    and loss > self.factor * abs(self.first))
        if not math.isfinite(loss) or exploded:
            advice = self.hint(loss, event.step) if self.hint else "lower the learning rate"
            what = (f"loss is {loss:.3g} at step {event.step}, over {self.factor:g} x the first step's "
                    f"{self.first:.3g}" if exploded else f"loss is {loss} at step {event.step}")
            raise TrainingDiverged(f"training diverged: {what}; {advice}")


class Checkpoint(Action):
    """Every `every` steps and after the last: `checkpointer.save(step, state, ...)` (a `jaxpar.Checkpointer`;
    asynchronous: the loop waits only for the copy off the devices). `extra()` returns JSON-serialisable values
    stored with it, e.g. `lambda: {"batches": batches.get_state()}` for an exact resume of the data order."""

    needs_state = True
    at_end = True

    def __init__(self, checkpointer, every: int, extra: Callable[[], dict] | None = None, at_end: bool = True):
        self.checkpointer, self.every, self.extra, self.at_end = checkpointer, every, extra, at_end
        self.saved: int | None = None  # the last step saved

    def __call__(self, event):
        if self.saved == event.step:
            return
        self.checkpointer.save(event.step, event.state, event.trainer.strategy, event.trainer.num_replicas,
                               **(self.extra() if self.extra else {}))
        self.saved = event.step


class CheckReplicas(Action):
    """Every `every` steps: every device's copy of the replicated parameters must be identical (a fingerprint per
    copy, `jaxpar.train.faults.ReplicaCheck`); a mismatch raises `ReplicaMismatch` naming the parameter and device."""

    needs_state = True

    def __init__(self, every: int):
        self.every = every
        self._checks: dict = {}

    def check(self, trainer, state, step: int) -> None:
        from jaxpar.train.faults import ReplicaCheck

        if id(trainer) not in self._checks:
            self._checks[id(trainer)] = ReplicaCheck(trainer.state_shardings.params, trainer.mesh)
        self._checks[id(trainer)].check(state.params, step)

    def __call__(self, event):
        self.check(event.trainer, event.state, event.step)


class StopWhen(Action):
    """When `requested(step)` turns true (asked once after every step; e.g. `StopRequest.at`): saves a checkpoint of
    that step through `checkpoint` (a `Checkpoint` action) and raises `Preempted(step)`; with `checkpoint` None it
    raises `Terminated` (the run ends as on SIGTERM)."""

    needs_state = True

    def __init__(self, requested: Callable[[int], bool], checkpoint: Checkpoint | None):
        self.requested, self.checkpoint = requested, checkpoint
        self._asked: tuple[int, bool] | None = None

    def due(self, step, last):
        # asked exactly once per step, in step order (the loop may call `due` twice): with several processes each
        # question is a step of an agreement all processes must take alike
        if self._asked is None or self._asked[0] != step:
            self._asked = (step, bool(self.requested(step)))
        return self._asked[1]

    def __call__(self, event):
        from jaxpar.errors import Preempted, Terminated

        if self.checkpoint is None:
            raise Terminated()
        self.checkpoint(event)
        raise Preempted(event.step)


STEP_MARKER = "jaxpar_step"  # the name of each traced step's jax.profiler.StepTraceAnnotation


class Trace(Action):
    """A `jax.profiler` trace of the steps that take the state from step `start` to step `stop` (`Trace(2, 4, dir)`:
    the 3rd and 4th updates), written under `folder` as `plugins/profile/<time>/<host>.xplane.pb` (TensorBoard's
    profile plugin, XProf) and `perfetto_trace.json.gz` (ui.perfetto.dev). Each traced step's dispatch is marked by
    a `jax.profiler.StepTraceAnnotation` named `jaxpar_step` with its `step_num`. The trace stops once step `stop`
    is done, or when `fit` ends before it (the last step, an error): never left running. Steps counted as
    `StepEvent.step`, so a resumed `fit` traces the same steps of the run."""

    def __init__(self, start: int, stop: int, folder, perfetto: bool = True):
        from jaxpar.checks import check_int

        check_int("Trace(start=...)", start, 0, "the step the trace starts at (0: before the first update)")
        check_int("Trace(stop=...)", stop, start + 1, f"the step the trace stops at, after start {start}")
        self.start, self.stop, self.folder, self.perfetto = start, stop, str(folder), perfetto
        self.active = False
        self.written: list[int] = []  # the steps traced so far (by their StepEvent.step)

    def due(self, step, last):
        return self.active and (step >= self.stop or last)

    def dispatching(self, step):
        import jax

        if not self.start < step <= self.stop:
            return None
        if not self.active:
            jax.profiler.start_trace(self.folder, create_perfetto_trace=self.perfetto)
            self.active = True
        self.written.append(step)
        return jax.profiler.StepTraceAnnotation(STEP_MARKER, step_num=step)

    def __call__(self, event):
        self.finish()

    def finish(self):
        if self.active:
            import jax

            self.active = False
            jax.profiler.stop_trace()
