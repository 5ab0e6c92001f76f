"""Resume compatibility: which options a resumed run may change, and how the config differs from a checkpoint's."""

from __future__ import annotations

from collections.abc import Mapping

from jaxpar.cli.options import declared, shown
from jaxpar.cli.pipelining import blocks_option
from jaxpar.cli.records import jsonable, to_record

# What a resumed run may change: the rest of the config must equal the checkpoint's. The pipeline schedule and
# --repeats only reorder the same computation (like the mesh); --microbatches too, unless `MATTERS_HERE` says not.
RESUME_MAY_CHANGE_GROUPS = ("mesh", "pipeline", "strategy", "run", "checkpoints and faults", "processes")
FOLLOWS_THE_REST = ("bn",)  # derived from options a resume may change (bn follows the strategy)


def _microbatches(config) -> str | None:
    """The stack draws dropout masks per microbatch: with dropout on, M is part of the run's math."""
    if config.dropout > 0 and blocks_option(config) is not None:
        return f"with --dropout {config.dropout:g} it decides the dropout masks; free to change with --dropout 0"
    return None


# options of the groups above that a resume may not change in some configs: option -> (config -> why, or None)
MATTERS_HERE = {"microbatches": _microbatches}


def resume_differences(config, saved: Mapping) -> list[str]:
    """The options a resumed run may not change whose value differs from `saved` (a checkpoint's `to_record()`),
    as `--flag now (checkpoint: saved)`."""
    mine = to_record(config)

    def differs(name) -> bool:
        return mine[name] != saved.get(name, mine[name])

    out = [f"{shown(config, name)} {jsonable(mine[name])!r} (checkpoint: {saved.get(name)!r})"
           for name, option in declared(config).items() if option.group not in RESUME_MAY_CHANGE_GROUPS
           and name not in FOLLOWS_THE_REST and differs(name)]
    for name, why in MATTERS_HERE.items():
        reason = why(config)
        if reason and differs(name):
            out.append(f"{shown(config, name)} {jsonable(mine[name])!r} (checkpoint: {saved.get(name)!r}; {reason})")
    if saved.get("seed", config.seed) != config.seed:
        out.append(f"--seed {config.seed} (checkpoint: {saved.get('seed')})")
    return out
