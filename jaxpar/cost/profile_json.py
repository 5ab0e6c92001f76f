"""A hardware profile as JSON: `Profile.to_dict` / `Profile.from_dict`, the checks every profile passes, and the
file `--hardware PATH.json` loads (what `python -m jaxpar.calibrate` writes).

    {"name": "...", "flops": 312e12, "sustained": 163e12, "memory": 80e9,
     "links": {"data": {"alpha": 1e-5, "bandwidth": 12.5e9}, ...},          (mesh axis -> link inside a node)
     "devices_per_node": 8, "inter_node": {"alpha": 1e-5, "bandwidth": 25e9}, "nics_per_node": 8,
     "allreduce": "ring", "overlap": false, "bucket": 25e6, "wire": "float32", "source": "...",
     "launch": 5.5e-5, "kinds": {"collective-permute": {"data": {"alpha": 1.5e-4, "bandwidth": 1e9}}},
     "model": "mlp",                              (a kind's own links; the model sustained and launch came from)
     "codecs": {"int8": {"seconds_per_element": 2e-9, "flops_per_element": 34, "replicas": 8}}}
                                                  (a codec's compute measured here, jaxpar.cost.codec_calibration)
"""
from __future__ import annotations

import json
import math
import os

from jaxpar.cost import pricing
from jaxpar.errors import OptionError
from jaxpar.parallel import mesh as mesh_lib

MEASUREMENTS = "calibration"  # the field where python -m jaxpar.calibrate keeps its sweeps and fits
NATIVE_ALLREDUCES = ("ring", "hierarchical")
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")  # how the compiler's all-reduce runs over nodes (jaxpar.cost.pricing)


def profile_from_dict(data: dict):
    """A `Profile` from its `to_dict` form; a missing or malformed field raises ValueError naming it."""
    from jaxpar.cost.hardware import Link, Profile
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    known = {f for f in Profile.__dataclass_fields__}
    data = {k: v for k, v in data.items() if k != MEASUREMENTS}  # a calibration's record: read by people, not priced
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; the fields are {', '.join(sorted(known))}")
    for needed in ("name", "flops", "links"):
        if needed not in data:
            raise ValueError(f"no {needed!r} field")

    def link(value, where):
        if not isinstance(value, dict) or set(value) != {"alpha", "bandwidth"}:
            raise ValueError(f"{where} must be {{\"alpha\": seconds, \"bandwidth\": bytes/s}}, got {value!r}")
        return Link(float(value["alpha"]), float(value["bandwidth"]))

    if not isinstance(data["links"], dict) or set(data["links"]) - set(mesh_lib.AXES):
        raise ValueError(f"'links' must map mesh axes ({', '.join(mesh_lib.AXES)}) to links")
    fields = dict(data, links={a: link(v, f"links.{a}") for a, v in data["links"].items()})
    kinds = data.get("kinds") or {}
    if not isinstance(kinds, dict) or any(k not in COLLECTIVE_KINDS or not isinstance(v, dict) or
                                          set(v) - set(mesh_lib.AXES) for k, v in kinds.items()):
        raise ValueError(f"'kinds' must map collective kinds ({', '.join(COLLECTIVE_KINDS)}) to links per mesh axis")
    fields["kinds"] = {k: {a: link(x, f"kinds.{k}.{a}") for a, x in v.items()} for k, v in kinds.items()}
    codecs = data.get("codecs") or {}
    fields_of_codec = {"seconds_per_element", "flops_per_element", "replicas"}
    if not isinstance(codecs, dict) or any(not isinstance(v, dict) or set(v) != fields_of_codec
                                           for v in codecs.values()):
        raise ValueError(f"'codecs' must map codec names to {{{', '.join(sorted(fields_of_codec))}}}")
    fields["codecs"] = {k: {"seconds_per_element": float(v["seconds_per_element"]),
                            "flops_per_element": float(v["flops_per_element"]), "replicas": v["replicas"]}
                        for k, v in codecs.items()}
    if data.get("inter_node") is not None:
        fields["inter_node"] = link(data["inter_node"], "inter_node")
    return check_profile(Profile(**fields))


def check_profile(profile):
    """Refuses a profile whose numbers cannot price anything (ValueError naming the field)."""
    def positive(value, what, zero=False):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                value < 0 or (value == 0 and not zero):
            raise ValueError(f"{what} must be a finite number > 0{' (or 0)' if zero else ''}, got {value!r}")

    positive(profile.flops, "flops")
    for what in ("sustained", "memory"):
        if getattr(profile, what) is not None:
            positive(getattr(profile, what), what)
    if not profile.links:
        raise ValueError("no links")
    own = [(f"kinds.{k}.{a}", x) for k, v in profile.kinds.items() for a, x in v.items()]
    for axis, x in list(profile.links.items()) + [("inter_node", profile.inter_node)] + own:
        if x is not None:
            positive(x.alpha, f"{axis}.alpha", zero=True)
            positive(x.bandwidth, f"{axis}.bandwidth")
    for what in ("devices_per_node", "nics_per_node"):
        value = getattr(profile, what)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    if (profile.devices_per_node is None) != (profile.inter_node is None):
        raise ValueError("devices_per_node and inter_node go together (a node needs a link to the others)")
    if profile.allreduce not in NATIVE_ALLREDUCES:
        raise ValueError(f"allreduce must be one of {', '.join(NATIVE_ALLREDUCES)}, got {profile.allreduce!r}")
    if profile.wire not in pricing.WIRE_BYTES:
        raise ValueError(f"wire must be one of {', '.join(pricing.WIRE_BYTES)}, got {profile.wire!r}")
    if not isinstance(profile.overlap, bool):
        raise ValueError(f"overlap must be true or false, got {profile.overlap!r}")
    if profile.model is not None and not isinstance(profile.model, str):
        raise ValueError(f"model must be a model's name or null, got {profile.model!r}")
    for name, c in profile.codecs.items():
        positive(c["seconds_per_element"], f"codecs.{name}.seconds_per_element")
        positive(c["flops_per_element"], f"codecs.{name}.flops_per_element")
        if isinstance(c["replicas"], bool) or not isinstance(c["replicas"], int) or c["replicas"] < 1:
            raise ValueError(f"codecs.{name}.replicas must be an integer >= 1, got {c['replicas']!r}")
    positive(profile.bucket, "bucket")
    positive(profile.launch, "launch", zero=True)
    return profile


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
                  f"profile name ({', '.join(profile_names())})")
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


def profile_names() -> list:
    from jaxpar.cost.hardware import PROFILES
    return list(PROFILES)
