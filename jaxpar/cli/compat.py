"""Resume compatibility: which fields a resumed run may change, and how the config differs from a checkpoint's."""

from __future__ import annotations

from collections.abc import Mapping

from jaxpar.cli.config import OPTIONS, Config
from jaxpar.cli.options import shown
from jaxpar.cli.records import jsonable

# What a resumed run may change: the rest of the config must equal the checkpoint's.
RESUME_MAY_CHANGE_GROUPS = ("mesh", "strategy", "run", "checkpoints and faults", "processes")
FOLLOWS_THE_REST = ("bn",)  # derived from fields a resume may change (bn follows the strategy)


def resume_differences(config: Config, saved: Mapping) -> list[str]:
    """The fields a resumed run may not change whose value differs from `saved` (a checkpoint's `to_record()`),
    as `--flag now (checkpoint: saved)`."""
    mine = config.to_record()
    out = [f"{shown(name)} {jsonable(mine[name])!r} (checkpoint: {saved.get(name)!r})"
           for name, meta in OPTIONS.items() if meta["group"] not in RESUME_MAY_CHANGE_GROUPS
           and name not in FOLLOWS_THE_REST and mine[name] != saved.get(name, mine[name])]
    if saved.get("seed", config.seed) != config.seed:
        out.append(f"--seed {config.seed} (checkpoint: {saved.get('seed')})")
    return out
