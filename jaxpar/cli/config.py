"""`jaxpar.Config`: the run configuration, one line per option (name, type, default, help) under its section.

What else is known about an option sits next to it in small tables, each in the module of its concern: which models
and strategies it applies to and their defaults (`options`, read from `models.REGISTRY` and
`jaxpar.strategies.REGISTRY`), its value check (`values.CHECKS`), checks across fields (`validation`), what a
resumed run may change (`compat`), the record a run writes (`records`) and its --help text (`help`). Model- and
strategy-specific fields default to None ("not given"); `resolved()` fills in the defaults that apply.

Presets live in `configs/NAME.py` as `get_config() -> jaxpar.Config`; CLI flags override their fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import models

from jaxpar.cli.options import GROUPS, MODEL_OF, MODELS, STRATEGIES, section
from jaxpar.strategies import BN_LOCAL, BN_SYNC
from jaxpar.cli.values import OPTIMIZERS, parse_decay_steps
from jaxpar.cost.hardware import PROFILES
from jaxpar.parallel.collectives import ALLREDUCE_ALGORITHMS
from jaxpar.pipeline.config import SCHEDULES
from jaxpar.train.remat import REMATS
from jaxpar.train.lr_schedules import LR_SCALINGS, LR_SCHEDULES

_mesh, _pipe, _arch, _data, _optim, _strategy, _large, _run, _faults, _procs = map(section, GROUPS)
_models = " | ".join(f"{name} ({spec.summary})" for name, spec in models.REGISTRY.items())


@dataclass
class Config:
    # --- mesh ---
    mesh: str = _mesh("2x4", "device mesh, axes data x stage x fsdp x model; -1 in one place = all remaining devices")
    rules: dict | list | None = _mesh(None, "logical axis -> mesh axis rules; None = jaxpar.DEFAULT_RULES with FSDP")
    # --- pipeline: how a model's jaxpar.pipeline.Stack runs over the stage axis (cross checks: cli/pipelining.py) ---
    pipeline: str = _pipe(SCHEDULES[0], f"schedule of the stacked layers over the stage axis: {' | '.join(SCHEDULES)}")
    microbatches: int = _pipe(1, "M pieces the batch is cut into on its way through the stacked layers; must divide "
                                 "the per-replica batch / --grad-accum")
    repeats: int = _pipe(1, "R chunks of layers per stage under --pipeline circular (a smaller bubble); --layers "
                            "must divide by stages x R")
    # --- model (per-model fields and their defaults: models.REGISTRY) ---
    model: str = _arch(MODELS[0], f"built-in model: {_models}")  # the first of models.REGISTRY
    dtype: str = _arch("float32", "compute dtype float32 | bfloat16 (parameters and optimizer state stay float32)")
    dropout: float = _arch(0.1, "dropout rate of the model")
    layers: int | None = _arch(None, "transformer blocks")
    block: str | None = _arch(None, "transformer block: llama (RMSNorm, rotary positions, SwiGLU, no biases) | gpt "
                                    "(LayerNorm, learned positions, GELU: the unstacked model's, for its checkpoints)")
    d_model: int | None = _arch(None, "width of the residual stream")
    heads: int | None = _arch(None, "attention heads; must divide --d-model, and divide by the model-axis size")
    d_ff: int | None = _arch(None, "transformer MLP width; must divide by the model-axis size")
    seq_len: int | None = _arch(None, "bytes (tokens) per training sequence")
    vocab: int | None = _arch(None, "vocabulary size, >= 256 for bytes; must divide by the model-axis size")
    hidden: int | None = _arch(None, "MLP hidden width")
    channels: tuple[int, int] | None = _arch(None, "CNN channels of its two conv layers")
    bn: str | None = _arch(None, f"BatchNorm statistics: {BN_SYNC} (global batch) | {BN_LOCAL} (each replica's slice)")
    # --- data ---
    data: str | None = _data(None, "text file or folder to train on")
    batch_size: int = _data(32, "GLOBAL batch size, split evenly over the batch axes (data x fsdp)")
    # --- optimizer ---
    optimizer: str = _optim("adamw", f"{' | '.join(OPTIMIZERS)} (momentum: SGD with momentum 0.9, as in Goyal et al.)")
    lr: float = _optim(3e-3, "peak learning rate")
    weight_decay: float = _optim(0.0, "decoupled weight decay (adamw) or L2 added to the gradient (sgd / momentum)")
    lr_schedule: str = _optim("constant", f"{' | '.join(LR_SCHEDULES)}, after warmup")
    warmup_steps: int = _optim(0, "gradual linear warmup from lr/W to lr over the first W steps")
    lr_decay_steps: str | None = _optim(None, "step schedule: comma-separated decay steps")
    lr_decay_factor: float = _optim(0.1, "step schedule: lr multiplier at each decay step")
    # --- update strategy (which strategies an option applies to, and its default there: jaxpar.strategies) ---
    # (default: the first of jaxpar.strategies.REGISTRY, synchronous SGD)
    strategy: str = _strategy(STRATEGIES[0], f"how replicas agree: {' | '.join(STRATEGIES)}")
    allreduce: str | None = _strategy(None, f"gradient/parameter averaging: {' | '.join(ALLREDUCE_ALGORITHMS)}")
    torus: int | None = _strategy(None, "torus2d: X of the X x Y grid over the data axis")
    compress: str | None = _strategy(None, "gradient compression on the wire: none | bf16 | fp16 | int8 | powersgd:R "
                                           "(int8:noef, powersgd:R:noef: without error feedback)")
    sync_period: int | None = _strategy(None, "local steps between meetings H")
    local_after: int | None = _strategy(None, "post-local SGD: synchronous for the first K steps")
    outer_lr: float | None = _strategy(None, "outer Nesterov SGD learning rate")
    outer_momentum: float | None = _strategy(None, "outer momentum")
    staleness: int | None = _strategy(None, "largest staleness S of an applied gradient (0 = BSP)")
    stragglers: str | None = _strategy(None, "simulated worker speeds (sets sim_time in the metrics)")
    hardware: str | None = _strategy(None, f"price sim_time and --explain on a profile ({', '.join(PROFILES)}) or spec")
    # --- large-batch toolkit ---
    lr_scaling: str = _large("none", f"{' | '.join(LR_SCALINGS)}: lr x (global batch / --base-batch-size) or its root")
    base_batch_size: int | None = _large(None, "the batch size --lr was tuned for")
    batch_ramp: str | None = _large(None, "progressive global batch 'SIZE:FROM_STEP,...', e.g. '32:0,64:100'")
    grad_accum: int = _large(1, "K microbatches per update (same update); must divide the per-replica batch")
    label_smoothing: float = _large(0.0, "label smoothing eps: targets (1 - eps) one-hot + eps / classes")
    # --- run ---
    steps: int = _run(300, "number of optimizer updates")
    seed: int = _run(0, "seed of initialisation, data order and dropout; same seed -> same run on any mesh")
    log_every: int = _run(10, "print and log every K steps")
    metrics: str | None = _run(None, "write one JSON object per logged step (step, loss, ...) to this .jsonl file")
    tensorboard: str | None = _run(None, "also write every logged number as TensorBoard event files into this folder")
    profile: str | None = _run(None, "write a jax.profiler trace of the steps from START to STOP, e.g. 2:4 (the 3rd "
                                     "and 4th updates)")
    profile_dir: str | None = _run(None, "the folder --profile writes its trace into")
    remat: str = _run(REMATS[0], f"rematerialization (recompute activations in the backward): {' | '.join(REMATS)}")
    no_compile_cache: bool = _run(False, "do not use JAX's persistent compilation cache (default folder: "
                                         "$JAXPAR_COMPILE_CACHE or ~/.cache/jaxpar/xla)")
    explain: bool = _run(False, "print the sharding plan, memory, collectives and FLOPs, then exit without training")
    plan: bool = _run(False, "rank meshes x strategies x remat on --hardware for --devices devices (projected step "
                             "time, memory), print the flags of the best, then exit without training")
    devices: int | None = _run(None, "with --plan: the number of devices to plan for (default: as many as --mesh uses)")
    eval_every: int = _run(0, "evaluate on the held-out split every N steps (0: only at the end)")
    eval_batches: int = _run(4, "held-out batches per evaluation (text; digits: the whole test split)")
    # --- checkpoints and numerical faults ---
    checkpoint_dir: str | None = _faults(None, "save checkpoints here (orbax: sharded, asynchronous, atomic)")
    checkpoint_every: int = _faults(100, "save a checkpoint every N steps (and at the end)")
    keep: int = _faults(3, "checkpoints kept in --checkpoint-dir (older ones are deleted)")
    resume: str | None = _faults(None, "continue from the latest checkpoint in --checkpoint-dir")
    resume_step: int | None = _faults(None, "with --resume: continue from this checkpoint step instead of the latest")
    on_nonfinite: str = _faults("skip", "a step whose loss or updated state is not finite: skip | abort")
    max_skips: int = _faults(10, "abort after more than this many consecutive skipped steps")
    check_every: int = _faults(100, "compare every device's copy of the replicated parameters every N steps; 0: never")
    # --- several processes (jaxpar.runtime.distributed); python -m jaxpar.launch sets them through the environment ---
    coordinator: str | None = _procs(None, "HOST:PORT of process 0 (the same on every process)")
    num_processes: int | None = _procs(None, "processes in the run (each with mesh size / N devices)")
    process_id: int | None = _procs(None, "this process's rank, 0 .. N-1 (process 0 prints, logs and writes)")

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def applies(self, name: str) -> bool:
        """Whether field `name` applies to this config's model and strategy."""
        return defaults.applies(self, name)

    def resolved(self) -> "Config":
        """A copy with every unset (None) field that applies replaced by its default (`jaxpar.cli.defaults`)."""
        return defaults.resolved(self)

    def validate(self) -> "Config":
        """Self, or a `ConfigError` naming the flag, the value and what would work (`jaxpar.cli.validation`)."""
        validation.validate(self)
        return self

    def resume_differences(self, saved: Mapping) -> list[str]:
        """The fields a resumed run may not change that differ from `saved` (`jaxpar.cli.compat`)."""
        return compat.resume_differences(self, saved)

    def decay_steps(self) -> tuple[int, ...] | None:
        return None if self.lr_decay_steps is None else parse_decay_steps(self.lr_decay_steps)

    def to_record(self) -> dict:
        """The full resolved config as a JSON-serialisable dict, plus {"versions": ...} (`jaxpar.cli.records`)."""
        return records.to_record(self)

    @classmethod
    def from_record(cls, record: Mapping) -> "Config":
        """The Config of a `to_record()` dict (`jaxpar.cli.records`)."""
        return records.from_record(cls, record)


def _metadata(f: dataclasses.Field) -> dict:
    from jaxpar.cli.options import CONST, DEFAULT_TEXT, FILE_ONLY, WHY
    from jaxpar.cli.values import CHECKS

    return {**f.metadata, "checks": CHECKS.get(f.name, ()), "flag": f.name not in FILE_ONLY, "models":
            MODEL_OF.get(f.name), "default_text": DEFAULT_TEXT.get(f.name), "why": WHY.get(f.name),
            "const": CONST.get(f.name)}


OPTIONS: dict[str, dict] = {f.name: _metadata(f) for f in dataclasses.fields(Config)}  # field -> all that is known
MODEL_DEFAULTS: dict[str, dict] = {model: {name: by_model[model] for name, by_model in MODEL_OF.items()
                                           if model in by_model} for model in MODELS}

# the modules Config's methods hand over to (they import Config: imported last)
from jaxpar.cli import compat, defaults, records, validation  # noqa: E402
