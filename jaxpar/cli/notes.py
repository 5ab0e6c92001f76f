"""What a run tells its user about its options: the ones that cannot act (at start, and once the mesh and the model
exist), the likely culprits when the loss diverges."""

from __future__ import annotations

import math

import jax

from jaxpar.cli import strategies
from jaxpar.cli.config import Config
from jaxpar.cli.context import context_notes
from jaxpar.cli.defaults import given
from jaxpar.cli.pipelining import blocks_option, spec_stages
from jaxpar.cli.values import parse_profile
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.compression import as_matrix_shape, parse_codec
from jaxpar.train.lr_schedules import parse_batch_ramp


def run_notes(config: Config) -> list[str]:
    """One line per option that cannot act in this run (printed, not refused: the run is still valid)."""
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
    return notes + profile_notes(config) + pipeline_notes(config) + context_notes(config)


def profile_notes(config: Config) -> list[str]:
    """--profile with nothing to trace: under --explain, or steps beyond --steps."""
    if config.profile is None:
        return []
    if config.explain:
        return [f"--profile {config.profile} with --explain: nothing trains, so nothing is traced"]
    start, stop = parse_profile(config.profile)
    if start >= config.steps:
        return [f"--profile {config.profile} starts at step {start}, at or after --steps {config.steps}: no step is "
                f"traced"]
    if stop > config.steps:
        return [f"--profile {config.profile} stops at step {stop}, after --steps {config.steps}: the trace covers the "
                f"steps from {start} to {config.steps}"]
    return []


def planning_notes(config: Config) -> list[str]:
    """The options --plan leaves unused (it trains nothing)."""
    if config.metrics:
        return [f"--metrics {config.metrics!r} with --plan: nothing trains, so no metrics file is written"]
    return []


def built_notes(config: Config, trainer) -> list[str]:
    """The options that cannot act, found once the mesh and the model exist: the pipeline flags on a stage axis that
    a -1 in --mesh made 1, a codec with nothing to compress."""
    notes = []
    if spec_stages(config) is None:
        notes += pipeline_notes(config, mesh_lib.size(trainer.mesh, mesh_lib.STAGE_AXIS), "whose stage axis has size 1")
    return notes + codec_notes(config, trainer)


def codec_notes(config: Config, trainer) -> list[str]:
    """--compress that compresses nothing: no exchange over data (a data axis of 1, and no fsdp leg the strategy
    compresses), or PowerSGD of a rank no parameter matrix is larger than."""
    if config.compress in (None, "none"):
        return []
    mesh, flag = trainer.mesh, f"--compress {config.compress}"
    fsdp_leg = getattr(trainer.strategy, "fsdp_leg_codec", None) and mesh_lib.size(mesh, mesh_lib.FSDP_AXIS) > 1
    if mesh_lib.replica_count(mesh) == 1 and not fsdp_leg:
        return [f"{flag} on --mesh {config.mesh}, whose data axis has size 1: no gradient is exchanged over data, so "
                f"nothing is compressed on the wire (each update still goes through the codec's rounding)"]
    codec = parse_codec(config.compress)
    shapes = [leaf.shape for leaf in jax.tree.leaves(trainer.ctx.abstract_params)]
    if not hasattr(codec, "compresses") or any(codec.compresses(shape) for shape in shapes):
        return []
    # the largest R with (n + m) R < n m, over the n x m matrices PowerSGD sees
    best = max(((n * m - 1) // (n + m) for n, m in map(as_matrix_shape, (s for s in shapes if len(s) >= 2))),
               default=0)
    fits = (f"; powersgd:{best} or a lower rank factorises at least one" if best else
            "; the model has no parameter matrix that a factorisation would shrink")
    return [f"{flag}: no parameter matrix is larger than its rank-{codec.rank} factors ((rows + columns) x "
            f"{codec.rank} >= rows x columns), so nothing is factorised and every gradient is sent whole{fits}"]


def pipeline_notes(config: Config, stages: int | None = None, where: str = "which has no stage axis") -> list[str]:
    """The pipeline flags that cannot act: no stacked layers in the model, or no stage axis to pipeline over.
    `stages`: the stage-axis size (default: the --mesh spec's; None there: a -1, not known yet)."""
    stages = spec_stages(config) if stages is None else stages
    scheduled = [f"--{name} {getattr(config, name)}" for name in ("pipeline", "repeats") if given(config, name)]
    if blocks_option(config) is None:
        changed = scheduled + ([f"--microbatches {config.microbatches}"] if given(config, "microbatches") else [])
        if changed and stages == 1:  # (stage > 1: the partitioner refuses the model with one line)
            return [f"{', '.join(changed)}: --model {config.model} has no stacked layers (jaxpar.pipeline.Stack), so "
                    f"nothing is pipelined or microbatched"]
    elif scheduled and stages == 1:
        return [f"{', '.join(scheduled)} on --mesh {config.mesh}, {where}: nothing is pipelined, the stacked layers "
                f"run as one scan (--microbatches still cuts the batch); add e.g. stage=2 to --mesh"]
    return []


def divergence_hint(config: Config, size_at):
    """`hint(loss, step)` for `StopIfDiverged`: the likely culprits among the options this run changed from their
    defaults, most likely first (a too-high lr, made higher by --lr-scaling; no warmup; a large batch)."""
    default = type(config)()
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
