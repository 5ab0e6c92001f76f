"""`--tensorboard DIR`: every number of a run's records as TensorBoard event files (tensorboardX)."""

from __future__ import annotations

import json
import os

from jaxpar.errors import JaxparError
from jaxpar.io.metrics import EVAL_PREFIX, strict_json


class TensorBoardFile:
    """Every number of every record as TensorBoard scalars in `directory` (event files written by tensorboardX):
    step records under `train/NAME`, evaluations under `eval/NAME`, each at its step; the configuration record
    and how the run ended as text. `tensorboard --logdir DIRECTORY` shows them."""

    def __init__(self, directory: str, flag: str = "--tensorboard"):
        try:
            os.makedirs(directory, exist_ok=True)
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(logdir=directory, flush_secs=10)
        except OSError as error:
            raise JaxparError(f"{flag} {directory!r}: cannot be written ({error.strerror or error}); pass a writable "
                              f"folder") from None
        self.directory = directory

    def write(self, record: dict) -> None:
        if "stopped" in record:
            self.writer.add_text("run/stopped", str(record["stopped"]))
            return
        if "step" not in record:  # the configuration
            self.writer.add_text("run/config", "    " + json.dumps(strict_json(record), indent=1).replace("\n", "\n    "))
            return
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            tag = f"eval/{key[len(EVAL_PREFIX):]}" if key.startswith(EVAL_PREFIX) else f"train/{key}"
            self.writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        self.writer.close()  # (a second close does nothing)
