"""What a run tells its user about its settings: the ones that cannot act (at start), the likely culprits when the
loss diverges."""

from __future__ import annotations

import math

from jaxpar import strategies
from jaxpar.cli.config import Config
from jaxpar.cli.defaults import given
from jaxpar.cli.pipelining import blocks_field, spec_stages
from jaxpar.train.lr_schedules import parse_batch_ramp


def run_notes(config: Config) -> list[str]:
    """One line per setting that cannot act in this run (printed, not refused: the run is still valid)."""
    steps, notes = config.steps, []
    if config.warmup_steps > steps:
        notes.append(f"--warmup-steps {config.warmup_steps} is larger than --steps {steps}: the lr never reaches "
                     f"its peak")
    if given(config, "sync_period") and config.sync_period > steps:
        notes.append(f"--sync-period {config.sync_period} is larger than --steps {steps}: the replicas never meet "
                     f"after their local steps")
    if given(config, "local_after") and config.local_after > steps:
        notes.append(f"--local-after {config.local_after} is larger than --steps {steps}: the whole run is "
                     f"synchronous")
    if given(config, "staleness") and config.staleness > steps:
        buffer = strategies.from_config(config).bounded_buffer  # the strategy plans at least --steps updates
        notes.append(f"--staleness {config.staleness} is larger than --steps {steps}: no gradient can be that stale, "
                     f"so no update ever waits for a slow replica (the version buffer holds {buffer})")
    if config.eval_every > steps:
        notes.append(f"--eval-every {config.eval_every} is larger than --steps {steps}: evaluation only at the end")
    if config.log_every > steps and given(config, "log_every"):
        notes.append(f"--log-every {config.log_every} is larger than --steps {steps}: only the first and last steps "
                     f"are logged")
    if config.batch_ramp:
        late = [f"{size}:{start}" for start, size in parse_batch_ramp(config.batch_ramp) if start >= steps]
        if late:
            notes.append(f"--batch-ramp stage(s) {','.join(late)} start at or after --steps {steps}: never used")
    if given(config, "checkpoint_every") and not config.checkpoint_dir:
        notes.append(f"--checkpoint-every {config.checkpoint_every} without --checkpoint-dir: no checkpoint is "
                     f"saved (add --checkpoint-dir DIR)")
    if given(config, "max_skips") and config.on_nonfinite == "abort":
        notes.append(f"--max-skips {config.max_skips} with --on-nonfinite abort: no step is skipped, the first "
                     f"non-finite step aborts the run (--max-skips applies to --on-nonfinite skip)")
    return notes + pipeline_notes(config)


def pipeline_notes(config: Config) -> list[str]:
    """The pipeline flags that cannot act: no stacked layers in the model, or no stage axis to pipeline over."""
    stages = spec_stages(config)  # None: a -1 in --mesh; the stage count is not known yet
    scheduled = [f"--{name} {getattr(config, name)}" for name in ("pipeline", "repeats") if given(config, name)]
    if blocks_field(config) is None:
        changed = scheduled + ([f"--microbatches {config.microbatches}"] if given(config, "microbatches") else [])
        if changed and stages == 1:  # (stage > 1: the partitioner refuses the model with one line)
            return [f"{', '.join(changed)}: --model {config.model} has no stacked layers (jaxpar.pipeline.Stack), so "
                    f"nothing is pipelined or microbatched"]
    elif scheduled and stages == 1:
        return [f"{', '.join(scheduled)} on --mesh {config.mesh}, which has no stage axis: nothing is pipelined, the "
                f"stacked layers run as one scan (--microbatches still cuts the batch); add e.g. stage=2 to --mesh"]
    return []


def divergence_hint(config: Config, size_at):
    """`hint(loss, step)` for `StopIfDiverged`: the likely culprits among the settings this run changed from their
    defaults, most likely first (a too-high lr, made higher by --lr-scaling; no warmup; a large batch)."""
    default = Config()
    base = config.base_batch_size or size_at(0)
    sizes = [size for _, size in getattr(size_at, "stages", [(0, size_at(0))])]
    scale = max(size / base for size in sizes)
    peak = config.lr * (scale if config.lr_scaling == "linear" else
                        math.sqrt(scale) if config.lr_scaling == "sqrt" else 1.0)

    def hint(loss: float, step: int) -> str:
        advice = []
        if config.lr != default.lr or config.optimizer != default.optimizer:
            advice.append(f"lower --lr (it is {config.lr:g} with --optimizer {config.optimizer}; try 10x smaller)")
        else:
            advice.append("lower --lr")
        if peak > config.lr * 1.0001:
            advice.append(f"--lr-scaling {config.lr_scaling} raises it to {peak:g} at the largest batch: use sqrt or "
                          f"a smaller --batch-ramp")
        if config.weight_decay > 0.1 and config.optimizer != "adamw":
            advice.append(f"lower --weight-decay (it is {config.weight_decay:g}: L2 that large makes SGD unstable)")
        if not config.warmup_steps:
            advice.append("add --warmup-steps")
        if config.batch_size != default.batch_size or config.batch_ramp:
            advice.append("or use a smaller --batch-size")
        return ", ".join(advice)

    return hint
