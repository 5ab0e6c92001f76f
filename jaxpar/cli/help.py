"""--help text of an option: its one-line help, more where a line is not enough, what it applies to and its default."""

from __future__ import annotations

from typing import Any

from jaxpar.cli.config import OPTIONS, Config
from jaxpar.cli.options import APPLIES_TO, STRATEGIES, strategy_default

MORE = {  # what --help adds to a declaration's one line
    "mesh": "'8' (data), '2x4' (data x model), '2x2x2' (data x fsdp x model), or named, e.g. 'data=2,fsdp=2,model=2' "
            "or 'fsdp=8' (absent axes have size 1); pipeline stages only by name, e.g. 'stage=4' or "
            "'data=2,stage=2,model=2' (the model needs stacked layers). On a CPU-only machine the needed CPU devices "
            "are created",
    "pipeline": "with S stages, M --microbatches, R --repeats: gpipe: autodiff through the forward ticks, activation "
                "memory grows with M; circular: R chunks of layers per stage, bubble (S-1)/(RM+S-1); 1f1b: a forward "
                "and a backward alternate on every stage, at most S stage inputs kept whatever M. Acts on a mesh "
                "with stage > 1 and a model with stacked layers (the transformer)",
    "microbatches": "more microbatches shrink the bubble (S-1)/(M+S-1); with dropout on, part of the math (masks are "
                    "drawn per microbatch, the same on every mesh)",
    "repeats": "R > 1 needs --microbatches >= stages",
    "stragglers": "'3:2.0' = replica 3 is 2x slower; add ',jitter=0.1' for seeded log-normal jitter",
    "hardware": "or 'flops=FLOP/s,alpha=s,bandwidth=B/s' (per axis: data.alpha=..., model.bandwidth=...), or a profile "
                "name or PATH.json followed by such overrides (sustained=, devices_per_node=, inter.alpha=, "
                "inter.bandwidth=, nics=, allreduce=ring|hierarchical, overlap=0|1, bucket=, wire=float32|bfloat16|"
                "float16); also the peak of flops_utilization",
    "batch_ramp": "replaces --batch-size; one compilation per size; lr follows --lr-scaling",
    "tensorboard": "tensorboardX; view with tensorboard --logdir FOLDER",
    "profile": "viewable in TensorBoard's profile plugin or ui.perfetto.dev; each step marked jaxpar_step",
    "explain": "of every step variant (with --hardware: projected step times)",
    "checkpoint_dir": "the latest --keep are kept; SIGTERM / Ctrl-C then saves one and exits 0",
    "resume": "'--resume' starts fresh (saying so) when there is none, '--resume required' refuses to",
    "on_nonfinite": "skip: the state stays bit-identical, counted in skipped_steps",
    "check_every": "a fingerprint, at the start and every N steps",
    "coordinator": "for a run over several processes / hosts; with --num-processes and --process-id",
}


def _allreduce_default() -> str:
    """What no --allreduce means, asked of the strategies: the compiler's averaging where replicas share one step."""
    from jaxpar.cli.strategies import CLASSES, WHOLE_BATCH

    others: dict = {}
    for name, cls in CLASSES.items():
        if name not in WHOLE_BATCH:
            others.setdefault(cls.DEFAULT_ALLREDUCE, []).append(name)
    return (f"none given: {' / '.join(WHOLE_BATCH)} leaves the averaging to XLA's partitioner, " +
            ", ".join(f"{' / '.join(names)} use {algorithm}" for algorithm, names in others.items()))


def describe(name: str) -> str:
    """The full help text of a field: its declared help, more, what it applies to and its default."""
    meta, default = OPTIONS[name], Config.__dataclass_fields__[name].default
    notes = []
    if meta["models"] is not None:
        notes.append(f"{' / '.join(meta['models'])} only")
    if name in APPLIES_TO and len(APPLIES_TO[name]) < len(STRATEGIES):
        notes.append(f"--strategy {' / '.join(APPLIES_TO[name])} only")
    if name == "allreduce":
        notes.append(f"default: {_allreduce_default()}")
    elif meta["default_text"] is not None:
        notes.append(f"default: {meta['default_text']}")
    elif name in APPLIES_TO:  # the strategies' own defaults
        by_value: dict[Any, list[str]] = {}
        for strategy in APPLIES_TO[name]:
            by_value.setdefault(strategy_default(strategy, name), []).append(strategy)
        notes.append("default: " + (f"{next(iter(by_value))}" if len(by_value) == 1 else
                                    ", ".join(f"{v} for {' / '.join(s)}" for v, s in by_value.items())))
    elif meta["models"] is not None:
        values = set(map(repr, meta["models"].values()))
        notes.append("default: " + (str(next(iter(meta["models"].values()))) if len(values) == 1 else
                                    ", ".join(f"{v} for {m}" for m, v in meta["models"].items())))
    elif default is not None:
        notes.append(f"default: {default}")
    more = f"; {MORE[name]}" if name in MORE else ""
    return meta["help"] + more + (f" ({'; '.join(notes)})" if notes else "")
