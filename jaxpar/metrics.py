"""Console progress and a JSONL metrics file: one JSON object per logged step, ready for pandas or plotting.

Every record has `step`, `loss`, `samples_per_sec` (over the steps since the previous record; the first record
covers only the first step, which includes compilation), `elapsed_sec`, and whatever the loss function returned.
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

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if step % self.log_every and step not in (1, self.total_steps):
            return
        now = time.perf_counter()
        samples = sum(self.batch_at(n) for n in range(self._last_step, step))
        rate = samples / max(now - self._last_time, 1e-9)
        record = {"step": step, **metrics, "samples_per_sec": rate, "elapsed_sec": now - self._start}
        self._last_step, self._last_time = step, now
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
