"""The run configuration: one dataclass, one comment per field, and `validate()` that turns every bad value into
one `ConfigError` line naming the CLI flag, the value and what would work.

Presets live in `configs/NAME.py` as `get_config() -> jaxpar.Config`; CLI flags override their fields.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass, field

from jaxpar.errors import ConfigError
from jaxpar.sharding import DEFAULT_RULES

MODELS = ("transformer", "mlp", "cnn")
OPTIMIZERS = ("adamw", "sgd", "momentum")
STRATEGIES = ("sync", "local_sgd", "diloco", "ssp", "asp")
# Which strategies each strategy-specific field applies to (a flag given for another strategy is an error).
APPLIES_TO = {
    "allreduce": STRATEGIES, "torus": STRATEGIES, "stragglers": STRATEGIES,
    "sync_period": ("local_sgd", "diloco"), "local_after": ("local_sgd", "diloco"),
    "outer_lr": ("diloco",), "outer_momentum": ("diloco",), "staleness": ("ssp",),
}


@dataclass
class Config:
    # --- run ---
    model: str = "transformer"  # which built-in model (models/): transformer | mlp | cnn
    mesh: str = "2x4"  # device mesh: "8", "2x4" (data x model) or "data=2,model=4"
    steps: int = 300  # number of optimizer updates
    batch_size: int = 32  # global batch size, split evenly over the data axis
    lr: float = 3e-3  # peak learning rate
    optimizer: str = "adamw"  # adamw | sgd | momentum (SGD with momentum 0.9, as in Goyal et al.)
    weight_decay: float = 0.0  # decoupled weight decay (adamw) or L2 added to the gradient (sgd / momentum)
    seed: int = 0  # initialisation, data order and dropout; same seed -> same run on every mesh
    data: str | None = None  # text file or folder for the transformer; None = the default corpus
    metrics: str | None = None  # JSONL file: one object per logged step
    log_every: int = 10  # print and log every this many steps
    eval_batches: int = 4  # held-out batches evaluated at the end of training
    rules: dict = field(default_factory=lambda: dict(DEFAULT_RULES))  # logical axis -> mesh axis (None = replicate)
    # --- update strategy (None = not given: the strategy's default) ---
    strategy: str = "sync"  # how replicas agree: sync | local_sgd | diloco | ssp | asp
    allreduce: str | None = None  # psum | ring | torus2d | ps; None: the partitioner's all-reduce (sync), psum (others)
    torus: int | None = None  # X of the X x Y torus2d grid; None: the divisor of the data-axis size nearest its sqrt
    sync_period: int | None = None  # local_sgd / diloco: local steps between meetings (default 4)
    local_after: int | None = None  # local_sgd / diloco: synchronous steps before going local (default 0)
    outer_lr: float | None = None  # diloco: outer Nesterov SGD learning rate (default 0.7)
    outer_momentum: float | None = None  # diloco: outer momentum (default 0.9)
    staleness: int | None = None  # ssp: largest staleness S of an applied gradient (default 2; 0 = BSP)
    stragglers: str | None = None  # simulated worker speeds, e.g. "3:2.0" (replica 3 2x slower), ",jitter=0.1"
    # --- large-batch toolkit ---
    eval_every: int = 0  # evaluate on the held-out split every N steps (0: only at the end)
    lr_scaling: str = "none"  # none | linear | sqrt: lr x (global batch / base_batch_size) or its square root
    base_batch_size: int | None = None  # the batch size `lr` was tuned for (default: the first global batch size)
    warmup_steps: int = 0  # linear warmup from lr/W to lr over the first W steps
    lr_schedule: str = "constant"  # constant | cosine | step (after warmup)
    lr_decay_steps: str | None = None  # step schedule: comma-separated steps (default: 50% and 75% of --steps)
    lr_decay_factor: float = 0.1  # step schedule: multiply lr by this at each decay step
    batch_ramp: str | None = None  # progressive global batch "SIZE:FROM_STEP,...", e.g. "32:0,64:100"; replaces batch_size
    label_smoothing: float = 0.0  # classification / LM targets (1 - eps) one-hot + eps / classes
    grad_accum: int = 1  # microbatches per update; must divide the per-replica batch
    bn: str | None = None  # BatchNorm statistics: sync (global batch) | local (each data shard); cnn only
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 (parameters and optimizer state stay float32)
    # --- transformer ---
    layers: int = 2  # transformer blocks
    d_model: int = 128  # width of the residual stream
    heads: int = 4  # attention heads (must divide by the model-axis size)
    d_ff: int = 512  # MLP hidden width (must divide by the model-axis size)
    seq_len: int = 128  # tokens (bytes) per training sequence
    vocab: int = 256  # byte-level vocabulary (must divide by the model-axis size)
    dropout: float = 0.1  # dropout rate of every model
    # --- mlp / cnn ---
    hidden: int = 128  # MLP hidden width
    channels: tuple[int, int] = (16, 32)  # CNN channels of its two conv layers

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def validate(self) -> "Config":
        self._validate_types()
        if self.model not in MODELS:
            raise ConfigError(f"--model {self.model!r} is not a model; choose one of {', '.join(MODELS)}")
        for flag, value, low in (("--steps", self.steps, 1), ("--batch-size", self.batch_size, 1),
                                 ("--log-every", self.log_every, 1), ("--layers", self.layers, 1),
                                 ("--d-model", self.d_model, 1), ("--heads", self.heads, 1), ("--d-ff", self.d_ff, 1),
                                 ("--seq-len", self.seq_len, 2), ("--vocab", self.vocab, 2), ("--hidden", self.hidden, 1),
                                 ("--eval-batches", self.eval_batches, 0), ("--seed", self.seed, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{flag} {value!r}: must be an integer >= {low}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            raise ConfigError(f"--lr {self.lr!r}: must be > 0, e.g. --lr 1e-3")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight-decay {self.weight_decay!r}: must be >= 0")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"--dropout {self.dropout!r}: must be in [0, 1)")
        if self.model == "transformer" and self.d_model % self.heads:
            raise ConfigError(f"--d-model {self.d_model} does not divide by --heads {self.heads}; "
                              f"choose d_model a multiple of heads")
        if self.model == "transformer" and self.vocab < 256:
            raise ConfigError(f"--vocab {self.vocab}: byte-level text needs a vocabulary of at least 256")
        self._validate_strategy()
        self._validate_large_batch()
        if self.metrics is not None:
            parent = os.path.dirname(os.path.abspath(self.metrics))
            if not os.path.isdir(parent):
                raise ConfigError(f"--metrics {self.metrics!r}: folder {parent!r} does not exist")
            if os.path.isdir(self.metrics) or not os.access(parent, os.W_OK):
                raise ConfigError(f"--metrics {self.metrics!r}: not a writable file path; pass e.g. run.jsonl")
        return self


    def _validate_types(self) -> None:
        """Config files can hold anything: wrong types fail here, in one line, not deep inside JAX."""
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), f.type
            flag = "--" + f.name.replace("_", "-")
            if value is None and "None" in kind:
                continue
            if kind.startswith("int") and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{flag} {value!r}: must be an integer")
            if kind.startswith("float") and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"{flag} {value!r}: must be a number")
            if kind.startswith("str") and not isinstance(value, str):
                raise ConfigError(f"{flag} {value!r}: must be a string")
        if not isinstance(self.rules, dict) or not all(
                isinstance(k, str) and (v is None or isinstance(v, str) or
                                        (isinstance(v, tuple) and all(isinstance(a, str) for a in v)))
                for k, v in self.rules.items()):
            raise ConfigError(f"rules {self.rules!r}: must map logical axis names to a mesh axis name, a tuple of "
                              f"them, or None")
        if not (isinstance(self.channels, (tuple, list)) and len(self.channels) == 2 and
                all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in self.channels)):
            raise ConfigError(f"channels {self.channels!r}: must be two positive integers, e.g. (16, 32)")
        if not 0 <= self.seed < 2 ** 32:
            raise ConfigError(f"--seed {self.seed}: must be in [0, 2**32)")

    def _validate_strategy(self) -> None:
        from jaxpar.strategies.simulator import parse_stragglers
        from jaxpar.strategies.sync import check_allreduce

        if self.strategy not in STRATEGIES:
            raise ConfigError(f"--strategy {self.strategy!r} is not a strategy; choose one of {', '.join(STRATEGIES)}")
        for name, strategies in APPLIES_TO.items():
            if getattr(self, name) is not None and self.strategy not in strategies:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)!r} does not apply to --strategy "
                                  f"{self.strategy}; it applies to {' / '.join(strategies)}")
        check_allreduce(self.allreduce, self.torus)
        for flag, value, low in (("--torus", self.torus, 1), ("--sync-period", self.sync_period, 1),
                                 ("--local-after", self.local_after, 0), ("--staleness", self.staleness, 0)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ConfigError(f"{flag} {value!r}: must be an integer >= {low}")
        if self.outer_lr is not None and not self.outer_lr > 0:
            raise ConfigError(f"--outer-lr {self.outer_lr!r}: must be > 0, e.g. --outer-lr 0.7")
        if self.outer_momentum is not None and not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum {self.outer_momentum!r}: must be in [0, 1), e.g. 0.9")
        parse_stragglers(self.stragglers)


    def _validate_large_batch(self) -> None:
        from jaxpar.schedules import LR_SCALINGS, LR_SCHEDULES, parse_batch_ramp

        for flag, value, low in (("--eval-every", self.eval_every, 0), ("--warmup-steps", self.warmup_steps, 0),
                                 ("--grad-accum", self.grad_accum, 1), ("--base-batch-size", self.base_batch_size, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ConfigError(f"{flag} {value!r}: must be an integer >= {low}")
        for flag, value, choices in (("--lr-scaling", self.lr_scaling, LR_SCALINGS),
                                     ("--lr-schedule", self.lr_schedule, LR_SCHEDULES),
                                     ("--dtype", self.dtype, ("float32", "bfloat16")),
                                     ("--bn", self.bn, ("sync", "local", None))):
            if value not in choices:
                raise ConfigError(f"{flag} {value!r}: choose one of {', '.join(c for c in choices if c)}")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"--label-smoothing {self.label_smoothing!r}: must be in [0, 1), e.g. 0.1")
        if not 0 < self.lr_decay_factor <= 1:
            raise ConfigError(f"--lr-decay-factor {self.lr_decay_factor!r}: must be in (0, 1], e.g. 0.1")
        if self.lr_decay_steps is not None:
            if self.lr_schedule != "step":
                raise ConfigError(f"--lr-decay-steps applies only to --lr-schedule step (got {self.lr_schedule})")
            self.decay_steps()
        if self.bn is not None and self.model != "cnn":
            raise ConfigError(f"--bn {self.bn}: the {self.model} model has no BatchNorm; --bn applies to --model cnn")
        if self.bn == "sync" and (self.strategy != "sync" or self.allreduce is not None):
            raise ConfigError("--bn sync needs --strategy sync without --allreduce; the explicit strategies "
                              "normalise each replica's slice (use --bn local)")
        if self.batch_ramp is not None:
            parse_batch_ramp(self.batch_ramp)

    def decay_steps(self) -> tuple[int, ...] | None:
        if self.lr_decay_steps is None:
            return None
        parts = [p.strip() for p in str(self.lr_decay_steps).split(",")]
        if not all(re.fullmatch(r"[0-9]+", p) for p in parts) or [int(p) for p in parts] != sorted({int(p) for p in parts}):
            raise ConfigError(f"--lr-decay-steps {self.lr_decay_steps!r}: must be increasing step numbers, "
                              f"e.g. 1000,2000")
        return tuple(int(p) for p in parts)


def load_config_file(path: str) -> Config:
    """Runs `get_config()` from a Python file (configs/NAME.py)."""
    if not os.path.isfile(path):
        here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
        names = sorted(f for f in os.listdir(here) if f.endswith(".py") and not f.startswith("_")) \
            if os.path.isdir(here) else []
        raise ConfigError(f"--config {path!r}: no such file" + (f"; presets: {', '.join('configs/' + n for n in names)}"
                                                                 if names else ""))
    spec = importlib.util.spec_from_file_location("jaxpar_user_config", path)
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
