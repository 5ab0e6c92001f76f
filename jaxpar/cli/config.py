"""The run configuration: every option declared once, as a `Config` field with its metadata.

A field's `option(...)` metadata holds everything else about it: help text, group, its own check, whether it is a
command-line flag, and which models it applies to (with its default for each). Which strategies an option applies
to, and its default there, is declared by the strategies themselves (`jaxpar.strategies.REGISTRY`, `OPTIONS`,
`COMMON_OPTIONS`) and only read here. `jaxpar.flags` generates the CLI from these declarations.

Model- and strategy-specific fields default to None ("not given"); giving one for another model or strategy is a
`ConfigError`. `resolved()` fills in the defaults that apply. `validate()` turns every bad value into one
`ConfigError` line naming the flag, the value and what would work.

Presets live in `configs/NAME.py` as `get_config() -> jaxpar.Config`; CLI flags override their fields.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.machinery
import importlib.util
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxpar import strategies as strategies_lib
from jaxpar.parallel.collectives import ALLREDUCE_ALGORITHMS
from jaxpar.io.data import path_kind
from jaxpar.errors import ConfigError
from jaxpar.cost.hardware import PROFILES, parse_hardware
from jaxpar.parallel.mesh import parse_mesh_spec
from jaxpar.train.schedules import LR_SCALINGS, LR_SCHEDULES, parse_batch_ramp
from jaxpar.cost.simulator import parse_stragglers
from jaxpar.parallel.collectives import check_allreduce

MODELS = ("transformer", "mlp", "cnn")
PRIMARY = ("model", "strategy")  # fields the others' applicability depends on  [field names, not mesh axes]
OPTIMIZERS = ("adamw", "sgd", "momentum")
GROUPS = ("mesh", "architecture", "dataset", "optimizer", "strategy", "large batch", "run", "checkpoints and faults",
          "processes")
# What a resumed run may change: the rest of the config must equal the checkpoint's (see `resume_differences`).
RESUME_MAY_CHANGE_GROUPS = ("mesh", "strategy", "run", "checkpoints and faults", "processes")

# Read from the strategies, never written here: names, and for each strategy-specific field the strategies it
# applies to (a field given for another strategy is an error).
STRATEGIES = tuple(strategies_lib.REGISTRY)
APPLIES_TO = {name: tuple(s for s, cls in strategies_lib.REGISTRY.items()
                          if name in strategies_lib.COMMON_OPTIONS or name in cls.OPTIONS)
              for name in dict.fromkeys([*strategies_lib.COMMON_OPTIONS,
                                         *(f for cls in strategies_lib.REGISTRY.values() for f in cls.OPTIONS)])}

# A check gets (shown name, value) of a given (not None) value and returns the one-line error, or None if fine
# (it may also raise a JaxparError itself).
Check = Callable[[str, Any], "str | None"]


def option(help: str, *, group: str, check: Check | tuple[Check, ...] = (), flag: bool = True,
           models: Mapping[str, Any] | None = None, default_text: str | None = None, why: str | None = None,
           const: Any = None) -> dict:
    """Metadata of one Config field.

    help: the flag's help text (without the default, which is added from the declaration);
    group: which concern it belongs to (one of GROUPS; --help lists flags by group);
    check: its own range/format check(s), run on a given value;
    flag: False for config-file-only fields;
    models: the models it applies to -> its default for each (None: every model); a callable default gets the
        config and returns the value;
    default_text: how --help states a default that is not a plain value;
    why: a hint added to the "does not apply" error;
    const: the value of the flag given without a value (`--resume` = `--resume auto`); None: the flag needs one.
    """
    assert group in GROUPS, group
    return {"help": help, "group": group, "checks": check if isinstance(check, tuple) else (check,), "flag": flag,
            "models": dict(models) if models is not None else None, "default_text": default_text, "why": why,
            "const": const}


# --- checks ---------------------------------------------------------------------------------------------------
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def at_least(low: int) -> Check:
    return lambda name, v: None if _is_int(v) and v >= low else f"{name} {v!r}: must be an integer >= {low}"


def within(test: Callable[[Any], bool], text: str) -> Check:
    return lambda name, v: None if test(v) else f"{name} {v!r}: {text}"


def one_of(choices, noun: str | None = None) -> Check:
    listed = ", ".join(choices)
    if noun:
        return lambda name, v: None if v in choices else f"{name} {v!r} is not a {noun}; choose one of {listed}"
    return lambda name, v: None if v in choices else f"{name} {v!r}: choose one of {listed}"


def parses(parse: Callable[[Any], Any]) -> Check:
    """A check by a parser that raises a JaxparError naming the flag itself."""
    def check(name, value):
        parse(value)

    return check


def _rules_check(name, rules):
    def axes_ok(target):
        return target is None or isinstance(target, str) or (
            isinstance(target, (tuple, list)) and all(isinstance(a, str) for a in target))

    if isinstance(rules, Mapping):
        ok = all(isinstance(k, str) and axes_ok(v) for k, v in rules.items())
    else:
        ok = isinstance(rules, (list, tuple)) and all(
            isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str) and axes_ok(pair[1])
            for pair in rules)
    if not ok:
        return (f"{name} {rules!r}: must map logical axis names to a mesh axis name, a tuple of them, or None (a dict,"
                f" or a Flax-style list of (logical name, mesh axis) pairs)")


def _channels_check(name, value):
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_int(c) and c >= 1 for c in value)):
        return f"{name} {value!r}: must be two positive integers, e.g. (16, 32)"


def _metrics_check(name, path):
    """Static checks of the metrics path; whether its folder really takes a file is probed when the run opens it
    (`jaxpar.io.metrics.JsonlFile`)."""
    if not path:
        return f"{name} {path!r}: empty path; pass a file name such as run.jsonl, or omit {name} to write none"
    kind = path_kind(path)
    if kind.startswith("a dangling"):
        return f"{name} {path!r}: is {kind}; pass the link's target or a new file name such as run.jsonl"
    if os.path.isdir(path):
        return f"{name} {path!r}: not a writable file path (a folder); pass e.g. {os.path.join(path, 'run.jsonl')}"
    if kind not in ("nothing", "a regular file"):
        return f"{name} {path!r}: is {kind}, not a regular file; pass a file name such as run.jsonl"
    parent = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(parent):
        return f"{name} {path!r}: folder {parent!r} does not exist; create it or pass e.g. run.jsonl"
    if not os.access(parent, os.W_OK):
        return f"{name} {path!r}: not a writable file path (folder {parent!r} is not writable); pass e.g. run.jsonl"
    if kind == "a regular file" and not _is_metrics_file(path):
        return (f"{name} {path!r}: exists and is not a jaxpar metrics file (its first line is not a config record); "
                f"pass a new file name, or delete the file first")


def _writable_folder(example: str) -> Check:
    """A folder the run writes into: an existing writable folder, or a new one in a writable folder."""
    def check(name, path):
        if not path:
            return f"{name} {path!r}: empty path; pass a folder such as {example}"
        if os.path.exists(path) and not os.path.isdir(path):
            return f"{name} {path!r}: is {path_kind(path)}, not a folder; pass a folder such as {example}"
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.exists(path) and not os.path.isdir(parent):
            return f"{name} {path!r}: folder {parent!r} does not exist; create it or pass e.g. {example}"
        target = path if os.path.exists(path) else parent
        if not os.access(target, os.W_OK | os.X_OK):
            return f"{name} {path!r}: folder {os.path.abspath(target)!r} is not writable; pass a writable folder"

    return check


_checkpoint_dir_check = _writable_folder("checkpoints/")


def _is_metrics_file(path) -> bool:
    """Empty, or its first line is the JSON config record a run writes first (so re-running overwrites safely)."""
    import json

    try:
        with open(path, "rb") as handle:
            first = handle.readline(1 << 20)
    except OSError:
        return True  # not readable: the write probe decides
    if not first.strip():
        return True
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and "versions" in record


def same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _finite_check(name, value):
    """Float fields: finite, and (an int from a config file) representable as a float."""
    try:
        ok = math.isfinite(float(value))
    except OverflowError:
        return f"{name} {_short(value)}: too large for a float; {_example(name)}"
    if not ok:
        return f"{name} {value!r}: must be a finite number; {_example(name)}"


def _example(name) -> str:
    field_name = name.lstrip("-").replace("-", "_")
    default = Config.__dataclass_fields__[field_name].default
    if default is None and field_name in APPLIES_TO:
        default = strategies_lib.option_default(APPLIES_TO[field_name][0], field_name)
    return f"e.g. {name} {default}" if default is not None else "pass a finite number"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


def _bn_default(config) -> str:
    """BatchNorm statistics follow the strategy: local when replicas compute on their own slice."""
    return "local" if strategies_lib.from_config(config).local_statistics else "sync"


@dataclass
class Config:
    # --- mesh ---
    mesh: str = field(default="2x4", metadata=option(
        "device mesh, axes data x fsdp x model: '8' (data), '2x4' (data x model), '2x2x2' (data x fsdp x model), or "
        "named, e.g. 'data=2,fsdp=2,model=2' or 'fsdp=8' (absent axes have size 1); -1 in one place = all remaining "
        "devices. On a CPU-only machine the needed CPU devices are created", group="mesh",
        check=parses(parse_mesh_spec)))
    rules: dict | list | None = field(default=None, metadata=option(
        "logical axis -> mesh axis rules: a dict, or a Flax-style list of (logical name, mesh axis) pairs; None = "
        "jaxpar.DEFAULT_RULES with automatic FSDP placement", group="mesh", flag=False, check=_rules_check))
    # --- model ---
    model: str = field(default="transformer", metadata=option(
        f"built-in model: {' | '.join(MODELS)} (transformer: byte-level LM; mlp, cnn: digits classifiers)",
        group="architecture",         check=one_of(MODELS, noun="model")))  # [not a mesh axis]
    dtype: str = field(default="float32", metadata=option(
        "compute dtype float32 | bfloat16 (parameters and optimizer state stay float32)", group="architecture",
        check=one_of(("float32", "bfloat16"))))
    dropout: float = field(default=0.1, metadata=option(
        "dropout rate of the model", group="architecture", check=within(lambda v: 0 <= v < 1, "must be in [0, 1)")))
    layers: int | None = field(default=None, metadata=option(
        "transformer blocks", group="architecture", models={"transformer": 2}, check=at_least(1)))
    d_model: int | None = field(default=None, metadata=option(
        "width of the residual stream", group="architecture", models={"transformer": 128}, check=at_least(1)))
    heads: int | None = field(default=None, metadata=option(
        "attention heads; must divide --d-model, and divide by the model-axis size", group="architecture",
        models={"transformer": 4}, check=at_least(1)))
    d_ff: int | None = field(default=None, metadata=option(
        "transformer MLP width; must divide by the model-axis size", group="architecture", models={"transformer": 512},
        check=at_least(1)))
    seq_len: int | None = field(default=None, metadata=option(
        "bytes (tokens) per training sequence", group="architecture", models={"transformer": 128}, check=at_least(2)))
    vocab: int | None = field(default=None, metadata=option(
        "vocabulary size, >= 256 for bytes; must divide by the model-axis size", group="architecture",
        models={"transformer": 256},
        check=(at_least(2), within(lambda v: v >= 256, "byte-level text needs a vocabulary of at least 256"))))
    hidden: int | None = field(default=None, metadata=option(
        "MLP hidden width", group="architecture", models={"mlp": 128}, check=at_least(1)))
    channels: tuple[int, int] | None = field(default=None, metadata=option(
        "CNN channels of its two conv layers", group="architecture", flag=False, models={"cnn": (16, 32)},
        check=_channels_check))
    bn: str | None = field(default=None, metadata=option(
        "BatchNorm statistics: sync (over the global batch) | local (each replica's slice)", group="architecture",
        models={"cnn": _bn_default}, check=one_of(("sync", "local")), why="only the cnn has BatchNorm",
        default_text="sync, or local under a strategy whose replicas compute on their own slice"))
    # --- data ---
    data: str | None = field(default=None, metadata=option(
        "text file or folder to train on", group="dataset", models={"transformer": None},
        default_text="the Python standard library's .py files", why="mlp and cnn train on the built-in digits dataset"))
    batch_size: int = field(default=32, metadata=option(
        "GLOBAL batch size, split evenly over the batch axes (data x fsdp)", group="dataset", check=at_least(1)))
    # --- optimizer ---
    optimizer: str = field(default="adamw", metadata=option(
        f"{' | '.join(OPTIMIZERS)} (momentum: SGD with momentum 0.9, as in Goyal et al.)", group="optimizer",
        check=one_of(OPTIMIZERS)))
    lr: float = field(default=3e-3, metadata=option(
        "peak learning rate", group="optimizer", check=within(lambda v: v > 0, "must be > 0, e.g. --lr 1e-3")))
    weight_decay: float = field(default=0.0, metadata=option(
        "decoupled weight decay (adamw) or L2 added to the gradient (sgd / momentum)", group="optimizer",
        check=within(lambda v: v >= 0, "must be >= 0")))
    lr_schedule: str = field(default="constant", metadata=option(
        f"{' | '.join(LR_SCHEDULES)}, after warmup", group="optimizer", check=one_of(LR_SCHEDULES)))
    warmup_steps: int = field(default=0, metadata=option(
        "gradual linear warmup from lr/W to lr over the first W steps", group="optimizer", check=at_least(0)))
    lr_decay_steps: str | None = field(default=None, metadata=option(
        "step schedule: comma-separated decay steps", group="optimizer",
        check=parses(lambda text: parse_decay_steps(text)),
        default_text="50% and 75% of --steps"))
    lr_decay_factor: float = field(default=0.1, metadata=option(
        "step schedule: lr multiplier at each decay step", group="optimizer",
        check=within(lambda v: 0 < v <= 1, "must be in (0, 1], e.g. 0.1")))
    # --- update strategy (which strategies an option applies to, and its default there: jaxpar.strategies) ---
    strategy: str = field(default="sync", metadata=option(
        f"how replicas agree: {' | '.join(STRATEGIES)}", group="strategy", check=one_of(STRATEGIES, noun="strategy")))
    allreduce: str | None = field(default=None, metadata=option(
        f"gradient/parameter averaging: {' | '.join(ALLREDUCE_ALGORITHMS)}", group="strategy", 
        check=parses(lambda value: check_allreduce(value, None)),
        default_text="XLA's partitioner for sync, psum otherwise"))
    torus: int | None = field(default=None, metadata=option(
        "torus2d: X of the X x Y grid over the data axis", group="strategy", check=at_least(1),
        default_text="the divisor of the data-axis size nearest its square root"))
    sync_period: int | None = field(default=None, metadata=option(
        "local steps between meetings H", group="strategy", check=at_least(1)))
    local_after: int | None = field(default=None, metadata=option(
        "post-local SGD: synchronous for the first K steps", group="strategy", check=at_least(0)))
    outer_lr: float | None = field(default=None, metadata=option(
        "outer Nesterov SGD learning rate", group="strategy",
        check=within(lambda v: v > 0, "must be > 0, e.g. --outer-lr 0.7")))
    outer_momentum: float | None = field(default=None, metadata=option(
        "outer momentum", group="strategy", check=within(lambda v: 0 <= v < 1, "must be in [0, 1), e.g. 0.9")))
    staleness: int | None = field(default=None, metadata=option(
        "largest staleness S of an applied gradient (0 = BSP)", group="strategy", check=at_least(0)))
    stragglers: str | None = field(default=None, metadata=option(
        "simulated worker speeds: '3:2.0' = replica 3 is 2x slower; add ',jitter=0.1' for seeded log-normal jitter "
        "(sets sim_time in the metrics)", group="strategy", check=parses(parse_stragglers), default_text="nobody slow"))
    hardware: str | None = field(default=None, metadata=option(
        f"price sim_time (and --explain's projection) on this hardware: a profile ({', '.join(PROFILES)}), or "
        f"'flops=FLOP/s,alpha=s,bandwidth=B/s' (per axis: data.alpha=..., model.bandwidth=...), or a profile "
        f"followed by such overrides; also the peak of flops_utilization", group="strategy",
        check=parses(parse_hardware), default_text="none: every step costs 1, communication is free"))
    # --- large-batch toolkit ---
    lr_scaling: str = field(default="none", metadata=option(
        f"{' | '.join(LR_SCALINGS)}: lr x (global batch / --base-batch-size) or its square root", group="large batch",
        check=one_of(LR_SCALINGS)))
    base_batch_size: int | None = field(default=None, metadata=option(
        "the batch size --lr was tuned for", group="large batch", check=at_least(1),
        default_text="the first global batch size"))
    batch_ramp: str | None = field(default=None, metadata=option(
        "progressive global batch 'SIZE:FROM_STEP,...', e.g. '32:0,64:100' (replaces --batch-size; one compilation "
        "per size; lr follows --lr-scaling)", group="large batch", check=parses(parse_batch_ramp)))
    grad_accum: int = field(default=1, metadata=option(
        "K microbatches per update (same update as the full batch); must divide the per-replica batch",
        group="large batch", check=at_least(1)))
    label_smoothing: float = field(default=0.0, metadata=option(
        "label smoothing eps: targets (1 - eps) one-hot + eps / classes, for classification and LM losses",
        group="large batch", check=within(lambda v: 0 <= v < 1, "must be in [0, 1), e.g. 0.1")))
    # --- run ---
    steps: int = field(default=300, metadata=option("number of optimizer updates", group="run", check=at_least(1)))
    seed: int = field(default=0, metadata=option(
        "seed of initialisation, data order and dropout; same seed -> same run on any mesh", group="run",
        check=within(lambda v: 0 <= v < 2 ** 32, "must be in [0, 2**32)")))
    log_every: int = field(default=10, metadata=option(
        "print and log every K steps", group="run", check=at_least(1)))
    metrics: str | None = field(default=None, metadata=option(
        "write one JSON object per logged step (step, loss, samples_per_sec, ...) to this .jsonl file", group="run",
        check=_metrics_check))
    tensorboard: str | None = field(default=None, metadata=option(
        "also write every logged number as TensorBoard event files into this folder (tensorboardX; view with "
        "tensorboard --logdir FOLDER)", group="run", check=_writable_folder("runs/")))
    explain: bool = field(default=False, metadata=option(
        "print the sharding plan, per-device memory, collectives against theory and FLOPs of every step variant "
        "(with --hardware: projected step times), then exit without training", group="run"))
    eval_every: int = field(default=0, metadata=option(
        "evaluate on the held-out split every N steps (0: only at the end)", group="run", check=at_least(0)))
    eval_batches: int = field(default=4, metadata=option(
        "held-out batches per evaluation (text; digits: the whole test split)", group="run", check=at_least(0)))
    # --- checkpoints and numerical faults ---
    checkpoint_dir: str | None = field(default=None, metadata=option(
        "save checkpoints here (orbax: sharded, asynchronous, atomic; the latest --keep are kept); SIGTERM / Ctrl-C "
        "then saves one and exits 0", group="checkpoints and faults", check=_checkpoint_dir_check))
    checkpoint_every: int = field(default=100, metadata=option(
        "save a checkpoint every N steps (and at the end)", group="checkpoints and faults", check=at_least(1)))
    keep: int = field(default=3, metadata=option(
        "checkpoints kept in --checkpoint-dir (older ones are deleted)", group="checkpoints and faults",
        check=at_least(1)))
    resume: str | None = field(default=None, metadata=option(
        "continue from the latest checkpoint in --checkpoint-dir: '--resume' starts fresh (saying so) when there is "
        "none, '--resume required' refuses to", group="checkpoints and faults", check=one_of(("auto", "required")),
        const="auto", default_text="off"))
    resume_step: int | None = field(default=None, metadata=option(
        "with --resume: continue from this checkpoint step instead of the latest", group="checkpoints and faults",
        check=at_least(0)))
    on_nonfinite: str = field(default="skip", metadata=option(
        "a step whose loss or updated state is not finite: skip (the state stays bit-identical; counted in "
        "skipped_steps) | abort", group="checkpoints and faults", check=one_of(("skip", "abort"))))
    max_skips: int = field(default=10, metadata=option(
        "abort after more than this many consecutive skipped steps", group="checkpoints and faults",
        check=at_least(0)))
    check_every: int = field(default=100, metadata=option(
        "compare every device's copy of the replicated parameters (a fingerprint) at the start and every N steps; "
        "0: never", group="checkpoints and faults", check=at_least(0)))
    # --- several processes (jaxpar.distributed); python -m jaxpar.launch sets them through the environment ---
    coordinator: str | None = field(default=None, metadata=option(
        "HOST:PORT of process 0 (the same on every process) for a run over several processes / hosts; with "
        "--num-processes and --process-id", group="processes", default_text="one process, or from the environment "
        "(jaxpar.launch, SLURM)", check=within(lambda v: isinstance(v, str) and v.count(":") >= 1 and
                                               v.rsplit(":", 1)[1].isdigit(), "must be HOST:PORT, e.g. 10.0.0.1:1234")))
    num_processes: int | None = field(default=None, metadata=option(
        "processes in the run (each with mesh size / N devices)", group="processes", check=at_least(1)))
    process_id: int | None = field(default=None, metadata=option(
        "this process's rank, 0 .. N-1 (process 0 prints, logs and writes the metrics)", group="processes",
        check=at_least(0)))

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    # --- what applies, and defaults -------------------------------------------------------------------------------
    def applies(self, name: str) -> bool:
        """Whether field `name` applies to this config's model and strategy."""
        models = OPTIONS[name]["models"]
        if models is not None and self.model not in models:
            return False
        return name not in APPLIES_TO or self.strategy in APPLIES_TO[name]

    def resolved(self) -> "Config":
        """A copy with every unset (None) field that applies replaced by its declared default; fields that do not
        apply stay None. Strategy options take the strategy's own defaults."""
        changes = {}
        for name, meta in OPTIONS.items():
            if getattr(self, name) is None and self.applies(name):
                if meta["models"] is not None:
                    changes[name] = meta["models"][self.model]
                elif name in APPLIES_TO:
                    changes[name] = strategies_lib.option_default(self.strategy, name)
        out = dataclasses.replace(self, **{k: v for k, v in changes.items() if not callable(v)})
        derived = {k: v(out) for k, v in changes.items() if callable(v)}  # defaults computed from the rest
        return dataclasses.replace(out, **derived) if derived else out

    # --- validation -----------------------------------------------------------------------------------------------
    def validate(self) -> "Config":
        self._validate_types()
        for name in PRIMARY:  # what the others apply to
            self._check(name)
        for name, meta in OPTIONS.items():
            value = getattr(self, name)
            if value is None or self.applies(name):
                continue
            if meta["models"] is not None and self.model not in meta["models"]:
                why = f" ({meta['why']})" if meta["why"] else ""
                raise ConfigError(f"{shown(name)} {value!r} does not apply to --model {self.model}; it applies to "
                                  f"{' / '.join(meta['models'])}{why}")
            raise ConfigError(f"{shown(name)} {value!r} does not apply to --strategy {self.strategy}; it applies to "
                              f"{' / '.join(APPLIES_TO[name])}")
        self._check_metrics_is_not_data()  # before --metrics' own checks: the more telling message
        for name in OPTIONS:
            if name not in PRIMARY and getattr(self, name) is not None:
                self._check(name)
        self._validate_combinations(self.resolved())
        return self

    def _check_metrics_is_not_data(self) -> None:
        metrics, text = self.metrics, self.data
        inside = text and os.path.isdir(text) and os.path.realpath(metrics or "").startswith(
            os.path.join(os.path.realpath(text), ""))
        if metrics and text and (same_file(metrics, text) or inside):
            raise ConfigError(f"--metrics {metrics!r}: is --data {text!r} or inside it (it would overwrite the "
                              f"training text, or be read as text by the next run); pass a path outside it, e.g. "
                              f"run.jsonl")

    def _check(self, name: str) -> None:
        for check in OPTIONS[name]["checks"]:
            message = check(shown(name), getattr(self, name))
            if message:
                raise ConfigError(message)

    def _validate_types(self) -> None:
        """Config files can hold anything: wrong types fail here, in one line, not deep inside JAX."""
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), f.type
            if value is None and "None" in kind:
                continue
            if kind.startswith("int") and not _is_int(value):
                raise ConfigError(f"{shown(f.name)} {value!r}: must be an integer")
            if kind.startswith("float") and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"{shown(f.name)} {value!r}: must be a number")
            if kind.startswith("float") and _finite_check(shown(f.name), value):
                raise ConfigError(_finite_check(shown(f.name), value))
            if kind.startswith("str") and not isinstance(value, str):
                raise ConfigError(f"{shown(f.name)} {value!r}: must be a string")

    @staticmethod
    def _validate_combinations(config: "Config") -> None:
        """Checks across fields, on the resolved config."""
        if config.model == "transformer" and config.d_model % config.heads:
            raise ConfigError(f"--d-model {config.d_model} does not divide by --heads {config.heads}; "
                              f"choose d_model a multiple of heads")
        check_allreduce(config.allreduce, config.torus)
        if config.resume is not None and config.checkpoint_dir is None:
            raise ConfigError(f"--resume {config.resume}: needs --checkpoint-dir (the folder to resume from)")
        if config.resume_step is not None and config.resume is None:
            raise ConfigError(f"--resume-step {config.resume_step}: applies only with --resume; add --resume")
        if config.checkpoint_dir and config.data and (
                same_file(config.checkpoint_dir, config.data) or os.path.realpath(config.checkpoint_dir).startswith(
                    os.path.realpath(config.data).rstrip(os.sep) + os.sep)):
            raise ConfigError(f"--checkpoint-dir {config.checkpoint_dir!r}: is --data {config.data!r} or inside it "
                              f"(its files would be read as training text); pass a folder outside it")
        if config.lr_decay_steps is not None and config.lr_schedule != "step":
            raise ConfigError(f"--lr-decay-steps applies only to --lr-schedule step (got {config.lr_schedule})")
        if config.bn == "sync" and strategies_lib.from_config(config).local_statistics:
            raise ConfigError("--bn sync needs --strategy sync without --allreduce; the explicit strategies "
                              "normalise each replica's slice (use --bn local)")

    def resume_differences(self, saved: Mapping) -> list[str]:
        """The fields a resumed run may not change (all but mesh, strategy, run and checkpoint options; `bn` follows
        the strategy) whose value differs from `saved` (a checkpoint's `to_record()`), as `--flag now (saved)`."""
        mine = self.to_record()
        return [f"{shown(name)} {_jsonable(mine[name])!r} (checkpoint: {saved.get(name)!r})" for name, meta in
                OPTIONS.items() if meta["group"] not in RESUME_MAY_CHANGE_GROUPS and name not in ("bn",)
                and mine[name] != saved.get(name, mine[name])] + (
            [f"--seed {self.seed} (checkpoint: {saved.get('seed')})"] if saved.get("seed", self.seed) != self.seed
            else [])

    def decay_steps(self) -> tuple[int, ...] | None:
        return None if self.lr_decay_steps is None else parse_decay_steps(self.lr_decay_steps)

    # --- records --------------------------------------------------------------------------------------------------
    def to_record(self) -> dict:
        """The full resolved config as a JSON-serialisable dict, plus {"versions": {package: version}}."""
        resolved = self.resolved()
        record = {f.name: _jsonable(getattr(resolved, f.name)) for f in dataclasses.fields(self)}
        record["versions"] = versions()
        return record

    @classmethod
    def from_record(cls, record: Mapping) -> "Config":
        """The Config of a `to_record()` dict (its "versions" and any unknown keys are ignored)."""
        values = {f.name: record[f.name] for f in dataclasses.fields(cls) if f.name in record}
        if isinstance(values.get("channels"), list):
            values["channels"] = tuple(values["channels"])
        if isinstance(values.get("rules"), list):
            values["rules"] = [(name, tuple(t) if isinstance(t, list) else t) for name, t in values["rules"]]
        elif isinstance(values.get("rules"), dict):
            values["rules"] = {k: tuple(t) if isinstance(t, list) else t for k, t in values["rules"].items()}
        return cls(**values)


OPTIONS: dict[str, dict] = {f.name: f.metadata for f in dataclasses.fields(Config)}  # field name -> option(...)
MODEL_DEFAULTS: dict[str, dict] = {model: {name: meta["models"][model] for name, meta in OPTIONS.items()
                                           if meta["models"] is not None and model in meta["models"]}
                                   for model in MODELS}  # the per-model table, read from the declarations


def shown(name: str) -> str:
    """How errors name a field: its flag, or the bare field name for config-file-only fields."""
    return "--" + name.replace("_", "-") if OPTIONS[name]["flag"] else name


def describe(name: str) -> str:
    """The full help text of a field: its declared help, what it applies to and its default."""
    meta, default = OPTIONS[name], Config.__dataclass_fields__[name].default
    notes = []
    if meta["models"] is not None:
        notes.append(f"{' / '.join(meta['models'])} only")
    if name in APPLIES_TO and len(APPLIES_TO[name]) < len(STRATEGIES):
        notes.append(f"--strategy {' / '.join(APPLIES_TO[name])} only")
    if meta["default_text"] is not None:
        notes.append(f"default: {meta['default_text']}")
    elif name in APPLIES_TO:  # the strategies' own defaults
        by_value: dict[Any, list[str]] = {}
        for strategy in APPLIES_TO[name]:
            by_value.setdefault(strategies_lib.option_default(strategy, name), []).append(strategy)
        notes.append("default: " + (f"{next(iter(by_value))}" if len(by_value) == 1 else
                                    ", ".join(f"{v} for {' / '.join(s)}" for v, s in by_value.items())))
    elif meta["models"] is not None:
        values = set(map(repr, meta["models"].values()))
        notes.append("default: " + (next(iter(meta["models"].values())).__str__() if len(values) == 1 else
                                    ", ".join(f"{v} for {m}" for m, v in meta["models"].items())))
    elif default is not None:
        notes.append(f"default: {default}")
    return meta["help"] + (f" ({'; '.join(notes)})" if notes else "")


def parse_decay_steps(text) -> tuple[int, ...]:
    parts = [p.strip() for p in str(text).split(",")]
    if not all(re.fullmatch(r"[0-9]+", p) for p in parts) or [int(p) for p in parts] != sorted({int(p) for p in parts}):
        raise ConfigError(f"--lr-decay-steps {text!r}: must be increasing step numbers, e.g. 1000,2000")
    return tuple(int(p) for p in parts)


def versions() -> dict[str, str | None]:
    """Installed versions of jaxpar and the libraries a run's numbers depend on."""
    out = {}
    for package in ("jaxpar", "jax", "flax", "optax"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = getattr(sys.modules.get(package), "__version__", None)
    return out


def _jsonable(value):
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


def load_config_file(path: str) -> Config:
    """Runs `get_config()` from a Python file (configs/NAME.py; any name: the file is read as Python source)."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise ConfigError(f"--config {path!r}: is {path_kind(path)}, not a file; pass a Python file such as "
                          f"configs/mlp.py")
    if not os.path.isfile(path):
        here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
        names = sorted(f for f in os.listdir(here) if f.endswith(".py") and not f.startswith("_")) \
            if os.path.isdir(here) else []
        raise ConfigError(f"--config {path!r}: no such file" + (f"; presets: {', '.join('configs/' + n for n in names)}"
                                                                 if names else ""))
    loader = importlib.machinery.SourceFileLoader("jaxpar_user_config", path)  # also for names without .py
    spec = importlib.util.spec_from_loader("jaxpar_user_config", loader)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not callable(getattr(module, "get_config", None)):
            raise ConfigError(f"--config {path!r}: defines no get_config() returning jaxpar.Config")
        config = module.get_config()
    except ConfigError:
        raise
    except Exception as error:  # a user's file: report it as a bad flag value, not a traceback
        raise ConfigError(f"--config {path!r}: could not be loaded ({type(error).__name__}: {error})") from error
    if not isinstance(config, Config):
        raise ConfigError(f"--config {path!r}: get_config() returned {type(config).__name__}, not jaxpar.Config")
    return config
