"""`run.py --resume`: which checkpoint to continue from, whether the config allows it, and the data position."""

from __future__ import annotations

import logging

from jaxpar.cli.config import Config
from jaxpar.errors import CheckpointError

log = logging.getLogger("jaxpar")


def resume_run(checkpoints, trainer, config: Config, batches) -> tuple[object | None, int, dict]:
    """(restored train state, its step, its metadata), or (None, 0, {}) to start fresh when `--resume` finds no
    checkpoint.
    Sets `batches` (a `jaxpar.io.data.Batches`) to the saved data position."""
    steps = checkpoints.steps()
    if not steps:
        if config.resume == "required" or config.resume_step is not None:
            raise CheckpointError(checkpoints.directory, "holds no checkpoint to resume from ({resume} required); "
                                                         "run without {resume} to start fresh")
        log.warning(f"--resume: no checkpoint in {checkpoints.directory} yet: starting fresh")
        return None, 0, {}
    step = config.resume_step if config.resume_step is not None else steps[-1]
    if step >= config.steps:
        raise CheckpointError(checkpoints.directory, f"its checkpoint of step {step} is already at or past "
                                                     f"{{steps}} {config.steps}; pass a larger {{steps}} to train on")
    saved_config = None
    if step in steps:
        try:
            saved_config = checkpoints.meta(step).get("config")
        except Exception:  # unreadable: `restore` names the problem and an intact older checkpoint
            saved_config = None
    if saved_config:
        differences = config.resume_differences(saved_config)
        if differences:
            raise CheckpointError(checkpoints.directory, f"the checkpoint of step {step} was written with another "
                                                         f"config: {', '.join(differences)}; resume with the "
                                                         f"checkpoint's values, or start a fresh run in another "
                                                         f"folder")
    state, meta, notes = checkpoints.restore(trainer, step)
    for line in notes:
        log.warning(line)
    moved = checkpoints.set_aside_newer(step)
    if moved:
        log.warning(f"checkpoints of steps {', '.join(map(str, moved))} are newer than the resumed step {step}: "
                    f"moved to {', '.join(moved.values())} (not deleted)")
    if meta.get("batches"):
        batches.set_state(meta["batches"])
    return state, step, meta
