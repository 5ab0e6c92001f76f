"""Validation: a config's types, each given value's own check, what applies, and the checks across fields; every
bad value is one `ConfigError` line naming the flag, the value and what would work."""

from __future__ import annotations

import dataclasses

from jaxpar.cli import strategies as strategies_lib
from jaxpar.checks import is_int
from jaxpar.cli.config import OPTIONS, Config
from jaxpar.cli.defaults import applies
from jaxpar.cli.options import APPLIES_TO, PRIMARY, shown
from jaxpar.strategies import BN_SYNC
from jaxpar.cli.paths import is_or_inside, profile_folder, writable_folder
from jaxpar.cli.pipelining import check_repeats, check_stages, spec_stages
from jaxpar.cli.values import finite_check
from jaxpar.errors import ConfigError
from jaxpar.parallel.collectives import check_allreduce

# outputs that must not be --data or inside it (they would overwrite the training text, or be read as text)
OUTPUTS_OUTSIDE_DATA = ("metrics", "tensorboard", "profile_dir", "checkpoint_dir")


def validate(config: Config) -> None:
    check_types(config)
    for name in PRIMARY:  # what the others apply to
        check_value(config, name)
    for name, meta in OPTIONS.items():
        value = getattr(config, name)
        if value is None or applies(config, name):
            continue
        if meta["models"] is not None and config.model not in meta["models"]:
            why = f" ({meta['why']})" if meta["why"] else ""
            raise ConfigError(f"{shown(name)} {value!r} does not apply to --model {config.model}; it applies to "
                              f"{' / '.join(meta['models'])}{why}")
        raise ConfigError(f"{shown(name)} {value!r} does not apply to --strategy {config.strategy}; it applies to "
                          f"{' / '.join(APPLIES_TO[name])}")
    check_outputs_outside_data(config)  # before the paths' own checks: the more telling message
    for name in OPTIONS:
        if name not in PRIMARY and getattr(config, name) is not None:
            check_value(config, name)
    check_combinations(config.resolved())


def check_value(config: Config, name: str) -> None:
    for check in OPTIONS[name]["checks"]:
        message = check(shown(name), getattr(config, name))
        if message:
            raise ConfigError(message)


def check_types(config: Config) -> None:
    """Config files can hold anything: wrong types fail here, in one line, not deep inside JAX."""
    for f in dataclasses.fields(config):
        value, kind = getattr(config, f.name), str(f.type)
        if value is None and "None" in kind:
            continue
        if kind.startswith("int") and not is_int(value):
            raise ConfigError(f"{shown(f.name)} {value!r}: must be an integer")
        if kind.startswith("float") and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{shown(f.name)} {value!r}: must be a number")
        if kind.startswith("float") and finite_check(shown(f.name), value):
            raise ConfigError(finite_check(shown(f.name), value))
        if kind.startswith("str") and not isinstance(value, str):
            raise ConfigError(f"{shown(f.name)} {value!r}: must be a string")


def check_outputs_outside_data(config: Config) -> None:
    """No output path is --data or inside it."""
    for name in OUTPUTS_OUTSIDE_DATA:
        path = getattr(config, name)
        if path and config.data and isinstance(path, str) and isinstance(config.data, str) and is_or_inside(
                path, config.data):
            raise ConfigError(f"{shown(name)} {path!r}: is --data {config.data!r} or inside it (it would overwrite the "
                              f"training text, or be read as text by the next run); pass a path outside it")


def check_combinations(config: Config) -> None:
    """Checks across fields, on the resolved config."""
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
    check_repeats(config)
    check_stages(config, spec_stages(config))  # a -1 in --mesh: checked again once the mesh exists
    if config.bn == BN_SYNC and strategies_lib.from_config(config).local_statistics:
        raise ConfigError(f"--bn sync needs --strategy {' / '.join(strategies_lib.WHOLE_BATCH)} without --allreduce; "
                          f"the explicit strategies normalise each replica's slice (use --bn local)")



def check_profile(config: Config) -> None:
    """--profile-dir only with --profile; the folder --profile writes into by default is checked like a given one."""
    if config.plan and not config.hardware:
        raise ConfigError("--plan: needs --hardware (the profile to plan for: a100-nvlink, a100-ib100, a100-eth10, "
                          "key=value items, or a file from python -m jaxpar.calibrate)")
    if config.plan and config.explain:
        raise ConfigError("--plan with --explain: give one of them (--plan ranks every mesh; --explain details this one)")
    if config.devices is not None and not config.plan:
        raise ConfigError(f"--devices {config.devices}: applies only with --plan (a run's devices come from --mesh)")
    if config.profile_dir is not None and config.profile is None:
        raise ConfigError(f"--profile-dir {config.profile_dir!r}: applies only with --profile; add e.g. --profile 2:4")
    if config.profile is not None and config.profile_dir is None and not config.tensorboard:
        folder = profile_folder(config)
        problem = writable_folder("--profile-dir traces/")(f"--profile {config.profile}: its default --profile-dir",
                                                          folder)
        if problem:
            raise ConfigError(problem)
        if config.data and is_or_inside(folder, config.data):
            raise ConfigError(f"--profile {config.profile}: its default folder {folder!r} is inside --data "
                              f"{config.data!r}; pass --profile-dir with a folder outside it")
