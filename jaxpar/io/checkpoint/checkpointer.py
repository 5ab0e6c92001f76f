"""The `Checkpointer`: save (asynchronous, atomic, with a manifest), list, wait, restore's entry point, and setting
newer checkpoints aside; the restore itself is in `restore.py`."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxpar.checks import check_int
from jaxpar.errors import CheckpointError
from jaxpar.io.checkpoint import restore as restore_lib
from jaxpar.io.checkpoint.manifest import FORMAT, verify, write_manifest
from jaxpar.io.checkpoint.naming import describe, first_line, flatten, is_key, strategy_name

SUPERSEDED = "superseded"  # where checkpoints newer than a resumed older one are moved (never deleted)


@contextlib.contextmanager
def quiet_orbax():
    """Orbax's own warnings (absl) silenced while a folder is listed or read: a folder that is not a checkpoint
    gets one line from jaxpar, not several `WARNING:absl:Metadata file does not exist` lines before it."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class Checkpointer:
    """Saves and restores `TrainState`s in `directory` (created if missing), keeping the latest `keep`.

        checkpoints = jaxpar.Checkpointer("ckpt", keep=3)
        state = trainer.fit(state, batches, 1000, actions=[jaxpar.train.actions.Checkpoint(checkpoints, every=100)])
        checkpoints.wait()
        state, meta, notes = checkpoints.restore(trainer)        # the latest, onto this trainer's mesh
    """

    def __init__(self, directory: str, keep: int = 3):
        check_int("keep ...", keep, 1, "checkpoints kept", error=lambda message: CheckpointError(directory, message))
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise CheckpointError(directory, "is not a folder")
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True)
        try:
            with quiet_orbax():
                self._manager = ocp.CheckpointManager(self.directory, options=options)
        except OSError as error:
            raise CheckpointError(directory, f"cannot be used ({error})") from None
        self._unverified: list[int] = []  # saved, manifest not yet written by `wait` (the save may still be running)
        self._writers: list[threading.Thread] = []  # background manifest writers not yet joined by `wait`
        self._stop_writers = threading.Event()  # set by `wait`: a writer still waiting for its folder gives up

    def folder(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first (interrupted saves are never listed)."""
        with quiet_orbax():
            self._manager.reload()
            return sorted(self._manager.all_steps())

    def save(self, step: int, state, strategy=None, num_replicas: int | None = None, **extra) -> None:
        """Starts saving `state` as step `step` and returns once the arrays are copied off the devices (the state
        may then be donated). `extra`: JSON-serialisable values stored with it (e.g. `data=`, `config=`)."""
        self.wait()
        flat, _, _ = flatten(state)
        meta = {"format": FORMAT, "step": int(step), "strategy": strategy_name(strategy) if strategy else None,
                "replicas": num_replicas, "leaves": describe(flat), **extra}
        arrays = {name: jax.random.key_data(x) if is_key(x) else x for name, x in flat.items()}
        self._manager.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                                                              meta=ocp.args.JsonSave(meta)), force=True)
        self._unverified.append(int(step))
        if jax.process_index() != 0:
            return  # process 0 writes the manifest (of every process's files, once orbax has renamed the folder)
        # the manifest as soon as orbax has renamed the finished checkpoint into place (so the newest checkpoint
        # is verified too when the process is killed before the next save); `wait` joins this thread
        writer = threading.Thread(target=self._manifest_when_final, args=(self.folder(int(step)), self._stop_writers),
                                  daemon=True)
        writer.start()
        self._writers.append(writer)

    @staticmethod
    def _manifest_when_final(folder: str, stop: threading.Event, timeout: float = 3600.0) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.isdir(folder):
            if stop.is_set() or time.monotonic() > deadline:
                return  # `wait` writes it (or the save failed / was deleted by max_to_keep)
            time.sleep(0.05)
        try:
            write_manifest(folder)
        except OSError:
            pass  # deleted meanwhile (max_to_keep), or the disk failed: `wait` reports it

    def _join_writers(self) -> None:
        """Every background manifest writer has ended (none writes after this returns)."""
        self._stop_writers.set()
        for writer in self._writers:
            writer.join()
        self._writers.clear()
        self._stop_writers = threading.Event()

    def wait(self) -> None:
        """Blocks until every started save is durable, and writes their manifests; no manifest is written after it
        returns (the background writers are joined first)."""
        try:
            self._manager.wait_until_finished()
            self._join_writers()
            for step in self._unverified if jax.process_index() == 0 else ():
                if os.path.isdir(self.folder(step)):  # (kept by max_to_keep)
                    write_manifest(self.folder(step))
        except Exception as error:  # orbax's background write or the manifest: a full disk, a vanished folder
            step = self._unverified[-1] if self._unverified else "?"
            raise CheckpointError(self.directory, f"saving the checkpoint of step {step} failed "
                                                  f"({first_line(error)}); free space or pass another folder") from None
        finally:
            self._join_writers()
            self._unverified.clear()

    def close(self, quiet: bool = False) -> None:
        """Waits until every save is durable; `quiet`: a failure is swallowed (another error is being reported)."""
        try:
            self.wait()
            self._manager.close()
        except Exception:
            if not quiet:
                raise

    # --- reading ----------------------------------------------------------------------------------------------
    def meta(self, step: int) -> dict:
        with quiet_orbax():
            return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def arrays(self, step: int) -> dict[str, np.ndarray]:
        """Every array of a checkpoint by name, as host numpy arrays (to inspect or compare checkpoints)."""
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        leaves = self.meta(step)["leaves"]
        arrays = self.read(step, {n: jax.ShapeDtypeStruct(tuple(d["shape"]), jnp.dtype(d["dtype"]), sharding=device)
                                  for n, d in leaves.items()})
        return {n: np.asarray(a) for n, a in arrays.items()}

    def read(self, step: int, abstract: dict) -> dict:
        """The arrays of `step` named in `abstract` (name -> `jax.ShapeDtypeStruct` with a sharding), placed so."""
        try:
            with quiet_orbax():
                return self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))[
                    "state"]
        except Exception as error:
            steps = self.steps()
            raise CheckpointError(self.directory, f"the checkpoint of step {step} is unusable: its arrays cannot "
                                                  f"be read ({first_line(error)}); {self._older_hint(step, steps)} "
                                                  f"(nothing was deleted)") from None

    def restore(self, trainer, step: int | None = None) -> tuple[object, dict, list[str]]:
        """(train state for `trainer`'s mesh and strategy, the checkpoint's metadata, notes) of `step` (default:
        the latest). Raises `CheckpointError` naming the step and file if it is missing, corrupt or of another
        model, and naming an older intact checkpoint if there is one. Nothing is deleted or overwritten."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(self.directory, "holds no checkpoint")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise CheckpointError(self.directory, f"has no checkpoint of step {step}; it has steps "
                                                  f"{', '.join(map(str, steps))}")
        problem = verify(self.folder(step))
        if problem is None:
            try:
                meta = self.meta(step)
            except Exception as error:  # orbax / tensorstore / JSON: any failure to read is the checkpoint's
                problem = f"its metadata cannot be read ({first_line(error)})"
        if problem is None and meta.get("format") != FORMAT:
            problem = f"it has format {meta.get('format')!r}, this jaxpar reads format {FORMAT}"
        if problem is None:
            state, notes = restore_lib.restore_state(self, step, meta, trainer)
            return state, meta, notes
        raise CheckpointError(self.directory, f"the checkpoint of step {step} is unusable: {problem}; "
                                              + self._older_hint(step, steps) + " (nothing was deleted)")

    def _older_hint(self, step: int, steps: list[int]) -> str:
        for older in reversed([s for s in steps if s < step]):
            if verify(self.folder(older)) is None:
                return f"the checkpoint of step {older} is intact: resume from it with {{resume_step}} {older}"
        return "there is no older intact checkpoint: start a fresh run in another folder"

    # --- after a resume from an older step --------------------------------------------------------------------
    def set_aside_newer(self, step: int) -> dict[int, str]:
        """Moves checkpoints newer than `step` into `DIR/superseded/` (a run resumed from `step` would write those
        steps again); returns {step: the folder it was moved to}. Nothing there is ever replaced: a step set aside
        before goes to `superseded/N.1`, `N.2`, ..."""
        newer = [s for s in self.steps() if s > step]
        several = jax.process_count() > 1
        if newer and several:  # every process has listed the folder before process 0 changes it
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jaxpar: checkpoints listed")
        aside = os.path.join(self.directory, SUPERSEDED)
        moved = {s: _free_name(aside, str(s)) for s in newer}  # (every process computes the same names)
        try:
            if newer and jax.process_index() == 0:
                os.makedirs(aside, exist_ok=True)
                for s, target in moved.items():
                    os.rename(self.folder(s), target)
                self._manager.reload()
        except OSError as error:
            raise CheckpointError(self.directory, f"cannot move the checkpoints newer than step {step} aside "
                                                  f"({error.strerror}); move or delete them yourself") from None
        if newer and several:  # the others wait until process 0 has moved them
            multihost_utils.sync_global_devices("jaxpar: checkpoints set aside")
            self._manager.reload()
        return moved


def _free_name(folder: str, name: str) -> str:
    """`folder/name`, or `folder/name.1`, `.2`, ... if taken."""
    target, copy = os.path.join(folder, name), 0
    while os.path.exists(target):
        copy += 1
        target = os.path.join(folder, f"{name}.{copy}")
    return target
