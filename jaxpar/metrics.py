"""Console progress and a JSONL metrics file: one JSON object per logged step, ready for pandas or plotting.

The first record is the run's resolved configuration (with library versions). Every step record has `step`,
`loss`, `samples_per_sec` (examples whose gradient was applied, over the steps since the previous record: under
SSP / ASP only the contributing replicas' examples count; the first record covers only the first step, which
includes compilation), `elapsed_sec`, and whatever the loss function and the strategy returned.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import IO


class RunLogger:
    def __init__(self, total_steps: int, global_batch, log_every: int, jsonl_path: str | None = None,
                 stream: IO[str] | None = None):
        self.total_steps, self.log_every = total_steps, log_every
        # global batch size of step n (0-based): an int, or a function for a batch-size ramp
        self.batch_at = global_batch if callable(global_batch) else (lambda step: global_batch)
        self.stream = stream
        self._file = open(jsonl_path, "w", encoding="utf-8") if jsonl_path else None
        self._start = self._last_time = time.perf_counter()
        self._last_step = 0
        self._examples = 0.0  # examples applied since the last record

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        """Call after every step; prints and records every `log_every` steps (and the first and last)."""
        metrics = dict(metrics)
        self._examples += metrics.pop("examples", self.batch_at(step - 1))
        if step % self.log_every and step not in (1, self.total_steps):
            return
        now = time.perf_counter()
        rate = self._examples / max(now - self._last_time, 1e-9)
        record = {"step": step, **metrics, "samples_per_sec": rate, "elapsed_sec": now - self._start}
        self._last_step, self._last_time, self._examples = step, now, 0.0
        self.write(record)
        remaining = (self.total_steps - step) * (now - self._start) / step if step > 1 else math.nan
        shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        eta = "" if math.isnan(remaining) else f"  eta {remaining:.0f}s"
        first = "  (includes compilation)" if step == 1 else ""
        print(f"step {step}/{self.total_steps}  {shown}  {rate:.0f} samples/s{eta}{first}", file=self.stream or sys.stdout,
              flush=True)

    def write(self, record: dict) -> None:
        """Appends one record to the JSONL file (if any); also used for evaluation results."""
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
