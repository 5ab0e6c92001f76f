"""Learning rate and batch size over training: the large-batch toolkit (Goyal et al. 2017; Smith et al. 2018).

    lr(step) = lr x scale(batch(step)) x warmup(step) x decay(step)

- scale: `none` = 1, `linear` = batch / base_batch, `sqrt` = sqrt(batch / base_batch);
- warmup: linear from lr/W to lr over the first W steps;
- decay: `constant`, `cosine` (from warmup's end down to 0 at step total_steps) or `step` (x factor at each boundary);
- batch(step): the global batch size, constant or a ramp `"256:0,512:1000"` (size from step), whose sizes each
  compile once, and the lr follows the scaling rule as the batch grows.
"""

from __future__ import annotations

import bisect
import math
import re

import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError

LR_SCALINGS = ("none", "linear", "sqrt")
LR_SCHEDULES = ("constant", "cosine", "step")


def parse_batch_ramp(spec: str, ways: int | None = None, steps: int | None = None) -> list[tuple[int, int]]:
    """"256:0,512:1000" -> [(0, 256), (1000, 512)] as (from_step, size), checked. With `steps`, sizes are checked
    against the `ways` devices the batch is split over, only for the stages that start before `steps` (the others never run)."""
    stages = []
    for item in spec.split(","):
        size, _, start = item.strip().partition(":")
        if not (re.fullmatch(r"[0-9]+", size) and re.fullmatch(r"[0-9]+", start)):
            raise ConfigError(f"--batch-ramp {spec!r}: {item!r} is not SIZE:FROM_STEP; e.g. '256:0,512:1000'")
        stages.append((int(start), int(size)))
    if stages[0][0] != 0:
        raise ConfigError(f"--batch-ramp {spec!r}: the first stage must start at step 0, e.g. '{stages[0][1]}:0,...'")
    for (start_a, size_a), (start_b, size_b) in zip(stages, stages[1:]):
        if not (start_b > start_a and size_b > size_a):
            raise ConfigError(f"--batch-ramp {spec!r}: steps and sizes must both increase ({size_a}:{start_a} is "
                              f"followed by {size_b}:{start_b})")
    for start, size in stages:
        if size < 1:
            raise ConfigError(f"--batch-ramp {spec!r}: size {size} of the stage from step {start} is not a batch; "
                              f"use sizes >= 1, e.g. '{max(ways or 1, 1)}:{start}'")
        if ways and size % ways and (steps is None or start < steps):
            raise ConfigError(f"--batch-ramp {spec!r}: size {size} does not divide by the {ways} devices the batch is "
                              f"split over; use multiples of {ways}")
    return stages


class BatchSizes:
    """step -> global batch size, piecewise constant: `stages` is [(from_step, size), ...] (one stage if no ramp)."""

    def __init__(self, stages: list[tuple[int, int]]):
        self.stages = list(stages)
        self._starts = [start for start, _ in self.stages]

    def __call__(self, step: int) -> int:
        return self.stages[bisect.bisect_right(self._starts, step) - 1][1]


def batch_size_fn(batch_size: int, ramp: list[tuple[int, int]] | None) -> BatchSizes:
    return BatchSizes(ramp if ramp else [(0, batch_size)])


def lr_schedule(lr: float, total_steps: int, *, scaling: str = "none", base_batch_size: int | None = None,
                batch_at=lambda step: 1, warmup_steps: int = 0, schedule: str = "constant",
                decay_steps: tuple[int, ...] | None = None, decay_factor: float = 0.1):
    """An optax-style schedule `step -> lr` (works on traced and host ints alike)."""
    base = base_batch_size or batch_at(0)
    boundaries = tuple(decay_steps) if decay_steps else tuple(sorted({max(total_steps // 2, 1),
                                                                     max(total_steps * 3 // 4, 1)}))
    # The batch-size factor is piecewise constant in the step. A `BatchSizes` (batch_size_fn) names its stages:
    # one factor per stage, looked up by the stage's start, so --steps 10**9 costs nothing. Any other function is
    # tabulated per step on the host (fine for short runs only).
    stages = getattr(batch_at, "stages", None)
    if stages is not None:
        starts = np.array([start for start, _ in stages if start < max(total_steps, 1)] or [0], np.int64)
        scales = np.array([_scale(scaling, size, base) for start, size in stages if start < max(total_steps, 1)]
                          or [_scale(scaling, batch_at(0), base)], np.float32)
    else:
        starts = np.arange(max(total_steps, 1), dtype=np.int64)
        scales = np.array([_scale(scaling, batch_at(t), base) for t in range(max(total_steps, 1))], np.float32)
    lr = float(lr)  # an int too big for a float is refused by Config; here it would raise OverflowError

    def at(step):
        step = jnp.asarray(step)
        stage = jnp.searchsorted(jnp.asarray(np.minimum(starts, 2 ** 31 - 1), jnp.int32), step, side="right") - 1
        value = lr * jnp.asarray(scales)[jnp.clip(stage, 0, len(scales) - 1)]
        if warmup_steps:
            value = value * jnp.minimum(1.0, (step + 1) / warmup_steps)
        if schedule == "cosine":
            progress = jnp.clip((step - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0, 1.0)
            value = value * 0.5 * (1 + jnp.cos(jnp.pi * progress))
        elif schedule == "step":
            value = value * decay_factor ** jnp.sum(step[..., None] >= jnp.asarray(boundaries), axis=-1)
        return value

    return at


def _scale(scaling: str, batch: int, base: int) -> float:
    if scaling == "linear":
        return batch / base
    if scaling == "sqrt":
        return math.sqrt(batch / base)
    return 1.0
