"""Validation: a config's types, each given value's own checks, what applies, and the checks across options; every
bad value is one `ConfigError` line naming the flag, the value and what would work."""

from __future__ import annotations

import dataclasses

import models
from jaxpar.checks import is_int
from jaxpar.cli import strategies
from jaxpar.cli.defaults import MODEL_OF, applies, resolved
from jaxpar.cli.options import declared, default_of, shown
from jaxpar.cli.paths import is_or_inside, profile_folder, trace_folder
from jaxpar.cli.runtimes import check_runtime
from jaxpar.cli.context import check_context, spec_seq
from jaxpar.cli.pipelining import check_repeats, check_stages, spec_stages
from jaxpar.cli.values import finite_check
from jaxpar.errors import ConfigError
from jaxpar.parallel.collectives import check_allreduce
from jaxpar.strategies import BN_SYNC

PRIMARY = ("model", "strategy")  # the options the others' applicability depends on
# outputs that must not be --data or inside it (they would overwrite the training text, or be read as text)
OUTPUTS_OUTSIDE_DATA = ("metrics", "tensorboard", "profile_dir", "checkpoint_dir")
_DIGITS_MODELS = [m for m, s in models.REGISTRY.items() if s.dataset == models.registry.DIGITS]
WHY = {  # a hint added to the "does not apply to --model" error
    "bn": "only the " + " / ".join(m for m, s in models.REGISTRY.items() if "bn" in s.defaults) + " has BatchNorm",
    "data": f"{' and '.join(_DIGITS_MODELS)} train on the built-in digits dataset",
}


def validate(config) -> None:
    check_types(config)
    for name in PRIMARY:  # what the others apply to
        check_value(config, name)
    for name in declared(config):
        value = getattr(config, name)
        if value is None or applies(config, name):
            continue
        if name in MODEL_OF and config.model not in MODEL_OF[name]:
            why = f" ({WHY[name]})" if name in WHY else ""
            raise ConfigError(f"{shown(config, name)} {value!r} does not apply to --model {config.model}; it applies "
                              f"to {' / '.join(MODEL_OF[name])}{why}")
        raise ConfigError(f"{shown(config, name)} {value!r} does not apply to --strategy {config.strategy}; it "
                          f"applies to {' / '.join(strategies.APPLIES_TO[name])}")
    check_outputs_outside_data(config)  # before the paths' own checks: the more telling message
    for name in declared(config):
        if name not in PRIMARY and getattr(config, name) is not None:
            check_value(config, name)
    check_combinations(resolved(config))


def check_value(config, name: str) -> None:
    for check in declared(config)[name].checks:
        message = check(shown(config, name), getattr(config, name))
        if message:
            raise ConfigError(message)


def _example(config, name: str):
    """A value of option `name` that works, for a message: its default (a strategy option's under the first
    strategy it applies to), or None."""
    default = default_of(config, name)
    if default is None and name in strategies.APPLIES_TO:
        default = strategies.option_default(strategies.APPLIES_TO[name][0], name)
    return default


def check_types(config) -> None:
    """Config files can hold anything: wrong types fail here, in one line, not deep inside JAX."""
    for f in dataclasses.fields(config):
        value, kind, name = getattr(config, f.name), str(f.type), shown(config, f.name)
        if value is None and "None" in kind:
            continue
        if kind.startswith("int") and not is_int(value):
            raise ConfigError(f"{name} {value!r}: must be an integer")
        if kind.startswith("float") and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{name} {value!r}: must be a number")
        if kind.startswith("float"):
            problem = finite_check(name, value, _example(config, f.name))
            if problem:
                raise ConfigError(problem)
        if kind.startswith("str") and not isinstance(value, str):
            raise ConfigError(f"{name} {value!r}: must be a string")


def check_outputs_outside_data(config) -> None:
    """No output path is --data or inside it."""
    for name in OUTPUTS_OUTSIDE_DATA:
        path = getattr(config, name)
        if path and config.data and isinstance(path, str) and isinstance(config.data, str) and is_or_inside(
                path, config.data):
            raise ConfigError(f"{shown(config, name)} {path!r}: is --data {config.data!r} or inside it (it would "
                              f"overwrite the training text, or be read as text by the next run); pass a path "
                              f"outside it")


def check_combinations(config) -> None:
    """Checks across options, on the resolved config."""
    if config.heads is not None and config.d_model % config.heads:
        raise ConfigError(f"--d-model {config.d_model} does not divide by --heads {config.heads}; "
                          f"choose d_model a multiple of heads")
    check_allreduce(config.allreduce, config.torus)
    if config.resume is not None and config.checkpoint_dir is None:
        raise ConfigError(f"--resume {config.resume}: needs --checkpoint-dir (the folder to resume from)")
    if config.resume_step is not None and config.resume is None:
        raise ConfigError(f"--resume-step {config.resume_step}: applies only with --resume; add --resume")
    if config.lr_decay_steps is not None and config.lr_schedule != "step":
        raise ConfigError(f"--lr-decay-steps applies only to --lr-schedule step (got {config.lr_schedule})")
    check_profile(config)
    check_runtime(config)
    check_repeats(config)
    check_stages(config, spec_stages(config))  # a -1 in --mesh: checked again once the mesh exists
    check_context(config, spec_seq(config))  # likewise
    if config.bn == BN_SYNC and strategies.from_config(config).local_statistics:
        raise ConfigError(f"--bn sync needs --strategy {' / '.join(strategies.WHOLE_BATCH)} without --allreduce or "
                          f"--compress; the explicit strategies normalise each replica's slice (use --bn local)")


def check_profile(config) -> None:
    """--profile-dir only with --profile; the folder --profile writes into by default (the --tensorboard folder, or
    profile/) is checked like a given one."""
    if config.plan and not config.hardware:
        raise ConfigError("--plan: needs --hardware (the profile to plan for: a100-nvlink, a100-ib100, a100-eth10, "
                          "key=value items, or a file from python -m jaxpar.calibrate)")
    if config.plan and config.explain:
        raise ConfigError("--plan with --explain: give one of them (--plan ranks every mesh; --explain details this one)")
    if config.devices is not None and not config.plan:
        raise ConfigError(f"--devices {config.devices}: applies only with --plan (a run's devices come from --mesh)")
    if config.profile_dir is not None and config.profile is None:
        raise ConfigError(f"--profile-dir {config.profile_dir!r}: applies only with --profile; add e.g. --profile 2:4")
    if config.profile is not None and config.profile_dir is None:
        folder = profile_folder(config)
        problem = trace_folder("--profile-dir traces/")(f"--profile {config.profile}: its default --profile-dir",
                                                       folder)
        if problem:
            raise ConfigError(problem)
        if config.data and is_or_inside(folder, config.data):
            raise ConfigError(f"--profile {config.profile}: its default folder {folder!r} is inside --data "
                              f"{config.data!r}; pass --profile-dir with a folder outside it")
