"""The fit loop: at most two steps in flight, actions run as their steps' metrics become ready.

Before dispatching step N+1 the loop waits for step N-1's metrics. Unbounded dispatch of collective-bearing steps
deadlocks XLA:CPU with many devices on few cores, and reading metrics one step late still overlaps host work with
the device. An action that needs the state runs before the next step is dispatched (that step donates the state).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping

import jax
import numpy as np

from jaxpar.checks import check_int
from jaxpar.errors import FitError, JaxparError, ModelCallError
from jaxpar.runtime.resources import DeviceError, wait_ready
from jaxpar.train.actions import Action, OnStep, StepEvent

PER_REPLICA_SUFFIX = "_per_replica"


def replica_means(metrics: Mapping) -> dict:
    """The metrics of a step that kept one value per replica (`[R]` arrays left on their devices, so that nothing
    crossed the replica axis), read to the host: each as its replica mean (a numpy array of the shape every other
    strategy gives, a scalar for `loss`) and whole under `<name>_per_replica`. Host metrics pass unchanged."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, jax.Array) and value.ndim:
            stacked = np.asarray(jax.device_get(value))
            out[key] = np.asarray(np.mean(stacked, axis=0))
            out[key + PER_REPLICA_SUFFIX] = stacked
        else:
            out[key] = value
    return out


def host_metrics(metrics: Mapping, per_replica: bool) -> dict:
    """A step's metrics on the host, the same keys and shapes for every strategy: scalars as floats, array metrics
    as numpy arrays (per-replica ones as their mean, and whole under `<name>_per_replica`: `replica_means`)."""
    host = jax.device_get(dict(replica_means(metrics) if per_replica else metrics))
    return {key: float(value) if np.ndim(value) == 0 else np.asarray(value) for key, value in host.items()}


@contextlib.contextmanager
def _around(actions, step: int, state, step_number: int):
    """The contexts the actions' `dispatching(step)` return, entered around one dispatch; a hook that fails is a
    FitError carrying the state (not yet donated)."""
    with contextlib.ExitStack() as stack:
        for action in actions:
            try:
                context = action.dispatching(step)
                if context is not None:
                    stack.enter_context(context)
            except Exception as error:
                raise FitError(f"action {getattr(action, 'label', type(action).__name__)} failed before step {step}: "
                               f"{type(error).__name__}: {error}", state, step_number) from error
        yield


def fit(trainer, state, batches: Iterable[Mapping], steps: int, actions: Iterable[Action] = (),
        on_step: Callable[[int, dict[str, float]], None] | None = None):
    """`Trainer.fit`: see its docstring."""
    check_int("steps", steps, 0, "the number of updates to run")
    trainer.check_state(state)
    actions = list(actions) + ([OnStep(on_step)] if on_step is not None else [])
    try:
        state, step_number = _steps(trainer, state, batches, steps, actions)
    except BaseException:
        _finish(actions, None, None)  # quietly: the error on its way out is the one to report
        raise
    _finish(actions, state, step_number)
    return state


def _hooked(actions, name: str) -> list:
    """The actions that override the optional hook `name` of `Action` (duck-typed actions may have none)."""
    return [a for a in actions if getattr(type(a), name, None) not in (None, getattr(Action, name))]


def _finish(actions, state, step) -> None:
    """Every action's `finish()`: all of them, even when one fails; with a state (fit succeeded) a failure is a
    FitError carrying it, else ignored."""
    failed = None
    for action in _hooked(actions, "finish"):
        try:
            action.finish()
        except Exception as error:
            failed = failed or (action, error)
    if failed is not None and state is not None:
        action, error = failed
        raise FitError(f"action {getattr(action, 'label', type(action).__name__)} failed at the end of fit: "
                       f"{type(error).__name__}: {error}", state, step) from error


def _steps(trainer, state, batches, steps, actions):
    around = _hooked(actions, "dispatching")
    iterator = iter(batches)
    step_number = int(jax.device_get(state.step))  # counted on the host: state.step is donated each step
    last = step_number + steps
    pending = None

    def run(pending, event_state, current_state, current_step):
        step, metrics, per_replica = pending
        wait_ready(metrics, step - 1)  # until that step is done; a step that failed on any device raises here
        is_last = step == last
        # an action that needs the state is only reached here without one when that state is already donated
        due = [a for a in actions if a.due(step, is_last) and not (a.needs_state and event_state is None)]
        if not due:
            return  # nobody reads this step's metrics: none is copied to the host (tens of us per metric)
        host = host_metrics(metrics, per_replica)
        for action in due:
            try:
                action(StepEvent(step, host, event_state if action.needs_state else None, trainer, is_last))
            except (KeyboardInterrupt, FitError):
                raise
            except JaxparError as error:
                raise FitError(str(error), current_state, current_step) from error
            except Exception as error:
                raise FitError(f"action {getattr(action, 'label', type(action).__name__)} failed at step {step}: "
                               f"{type(error).__name__}: {error}", current_state, current_step) from error

    for _ in range(steps):
        try:
            batch = next(iterator)
        except StopIteration:
            if pending is not None:
                run(pending, state, state, step_number)
            raise FitError(f"the batch iterator ran out after {step_number} steps of {last}; give fit an "
                           f"endless iterator or fewer steps", state, step_number) from None
        try:
            if around:
                with _around(around, step_number + 1, state, step_number):
                    new_state, metrics, per_replica = trainer.dispatch(state, batch, step_number)
            else:
                new_state, metrics, per_replica = trainer.dispatch(state, batch, step_number)
        except DeviceError:
            raise  # the state is gone with the failed step: nothing to carry in a FitError
        except JaxparError as error:
            if pending is not None:
                run(pending, state, state, step_number)
            # the model's own exception (ModelCallError: step and batch shapes already said) is the cause itself
            raise FitError(str(error), state, step_number) from (
                error.__cause__ if isinstance(error, ModelCallError) and error.__cause__ is not None else error)
        state, step_number = new_state, step_number + 1
        if pending is not None:
            run(pending, None, state, step_number)
        pending = (step_number, metrics, per_replica)
        if any(a.needs_state and a.due(step_number, step_number == last) for a in actions):
            run(pending, state, state, step_number)
            pending = None
    if pending is not None:
        run(pending, state, state, step_number)
    return state, step_number
