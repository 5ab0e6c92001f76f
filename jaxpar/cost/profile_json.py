"""A hardware profile's JSON file: what `--hardware PATH.json` loads and `python -m jaxpar.calibrate` writes (the
fields: `jaxpar.cost.profile`)."""
from __future__ import annotations

import json
import os

from jaxpar.cost.builtin_profiles import PROFILES
from jaxpar.cost.profile import profile_from_dict
from jaxpar.errors import OptionError


def save_profile(profile, path) -> None:
    """Writes `profile` as JSON (what `--hardware PATH.json` loads)."""
    with open(path, "w") as f:
        json.dump(profile.to_dict(), f, indent=1)


def load_profile(path):
    """The profile in JSON file `path`; a missing or unreadable file, or a bad field, is an OptionError."""
    def bad(why):
        return OptionError("hardware", str(path), why)

    if not os.path.isfile(path):
        raise bad(f"no such file; give a profile file (JSON, as python -m jaxpar.calibrate writes) that exists, or a "
                  f"profile name ({', '.join(PROFILES)})")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad(f"cannot read it as JSON ({str(error).splitlines()[0]}); give a profile file as python -m "
                  f"jaxpar.calibrate writes") from None
    try:
        return profile_from_dict(data)
    except (TypeError, ValueError) as error:
        raise bad(f"not a hardware profile: {error}") from None


def is_profile_file(path) -> bool:
    """Whether the existing file `path` is empty or holds a hardware profile (so writing a new one over it loses
    nothing that is not a profile)."""
    try:
        with open(path, "rb") as handle:
            text = handle.read()
    except OSError:
        return True  # not readable: writing it will say why
    if not text.strip():
        return True
    try:
        profile_from_dict(json.loads(text))
    except (TypeError, ValueError):  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        return False
    return True
