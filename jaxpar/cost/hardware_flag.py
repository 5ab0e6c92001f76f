"""The `--hardware` flag (`jaxpar.parse_hardware`): a built-in profile's name or a profile file, and/or key=value
items that set or override its fields. Each key is given at most once."""
from __future__ import annotations

import math
import os
from dataclasses import replace

from jaxpar.cost import pricing
from jaxpar.cost.builtin_profiles import PROFILES
from jaxpar.cost.profile import NATIVE_ALLREDUCES, Link, Profile, check_profile
from jaxpar.cost.profile_json import load_profile
from jaxpar.errors import OptionError
from jaxpar.parallel import mesh as mesh_lib

_ITEMS = {"flops": "peak FLOP/s", "sustained": "sustained FLOP/s", "memory": "bytes per device",
          "alpha": "seconds", "bandwidth": "bytes/s", "devices_per_node": "N", "nics": "NICs per node",
          "inter.alpha": "seconds between nodes", "inter.bandwidth": "bytes/s per NIC",
          "allreduce": "|".join(NATIVE_ALLREDUCES), "overlap": "0|1", "bucket": "bytes",
          "wire": "|".join(pricing.WIRE_BYTES), "launch": "seconds"}
_HELP = (f"expected a profile name ({', '.join(PROFILES)}) or a JSON file (PATH.json) and/or comma-separated "
         f"key=value items: {', '.join(f'{k}={v}' for k, v in _ITEMS.items())}, or per axis AXIS.alpha / "
         f"AXIS.bandwidth, e.g. 'flops=100e12,alpha=1e-5,bandwidth=12.5e9' or 'a100-nvlink,data.bandwidth=1.25e9'")


def _is_file(item: str) -> bool:
    return item.endswith(".json") or os.sep in item


def parse_hardware(spec) -> Profile | None:
    """The `--hardware` flag: NAME or PATH.json, key=value items, or either followed by items that override it.
    None: no profile. A key given twice is refused (which one was meant cannot be known)."""
    if spec is None or isinstance(spec, Profile):
        return spec
    text = str(spec).strip()
    if not text:
        return None

    def bad(why: str) -> OptionError:
        return OptionError("hardware", spec, why)

    items = [item.strip() for item in text.split(",")]
    base = None
    if items and "=" not in items[0]:
        if _is_file(items[0]):
            base = load_profile(items[0])
        elif items[0] not in PROFILES:
            raise bad(f"unknown profile {items[0]!r}; {_HELP}")
        else:
            base = PROFILES[items[0]]
        items = items[1:]
    _refuse_repeated_keys(items, bad)
    fields = {f: getattr(base, f) for f in Profile.__dataclass_fields__} if base else {"name": text, "flops": None}
    fields["links"] = dict(base.links) if base else {}
    every, per_axis, inter = _read_items(items, fields, bad)
    _place_links(fields, every, per_axis, inter, bad)
    if fields["flops"] is None:
        raise bad(f"no flops= (peak FLOP/s per device) given; {_HELP}")
    fields["name"] = text if base is None or items else base.name
    fields["source"] = ((base.source + ("; overridden: " + ", ".join(items) if items else "")) if base
                        else "given on the command line")
    try:
        return check_profile(Profile(**fields))
    except ValueError as error:
        raise bad(f"{error}; {_HELP}") from None


def _refuse_repeated_keys(items, bad) -> None:
    seen: dict = {}
    for item in items:
        key, sep, _ = item.partition("=")
        key = key.strip()
        if sep and key in seen:
            raise bad(f"key {key!r} given twice ({seen[key]!r} and {item!r}); give each key once")
        seen[key] = item


def _read_items(items, fields: dict, bad) -> tuple[dict, dict, dict]:
    """Sets the scalar fields the items give in `fields`; returns the link values they give: (for every axis, per
    axis, between nodes)."""
    every: dict = {}
    per_axis: dict = {}
    inter: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise bad(f"cannot read {item!r}; {_HELP}")
        if key == "allreduce" and value in NATIVE_ALLREDUCES or key == "wire" and value in pricing.WIRE_BYTES:
            fields[key] = value
            continue
        if key in ("allreduce", "wire"):
            raise bad(f"{item!r}: {key} must be one of {_ITEMS[key].replace('|', ', ')}; {_HELP}")
        if key == "overlap" and value in ("0", "1"):
            fields["overlap"] = value == "1"
            continue
        if key == "overlap":
            raise bad(f"{item!r}: overlap must be 0 (off: the no-overlap bound) or 1 (on)")
        try:
            number = float(value)
        except ValueError:
            raise bad(f"cannot read {item!r}; {_HELP}") from None
        if not math.isfinite(number) or number < 0 or (number == 0 and not key.endswith(("alpha", "launch"))):
            raise bad(f"{item!r}: the value must be a finite number > 0 (alpha and launch may be 0); {_HELP}")
        axis, dot, what = key.rpartition(".")
        if key in ("flops", "sustained", "memory", "bucket", "launch"):
            fields[key] = number
        elif key in ("devices_per_node", "nics"):
            if number != int(number) or number < 1:
                raise bad(f"{item!r}: {key} must be a whole number >= 1")
            fields["nics_per_node" if key == "nics" else key] = int(number)
        elif not dot and key in ("alpha", "bandwidth"):
            every[key] = number
        elif dot and axis == "inter" and what in ("alpha", "bandwidth"):
            inter[what] = number
        elif dot and axis in mesh_lib.AXES and what in ("alpha", "bandwidth"):
            per_axis.setdefault(axis, {})[what] = number
        else:
            raise bad(f"unknown key {key!r}; {_HELP}")
    return every, per_axis, inter


def _place_links(fields: dict, every: dict, per_axis: dict, inter: dict, bad) -> None:
    """Every axis's link in `fields["links"]` and the link between nodes, from the base's and the items'."""
    links = fields["links"]
    from_base = bool(links)  # a base profile may leave an axis out (older files have no seq): its slowest link prices it
    for axis in mesh_lib.AXES:
        old = links.get(axis)
        given = {**every, **per_axis.get(axis, {})}
        if old is None and not given and from_base:
            continue
        if old is None and set(given) != {"alpha", "bandwidth"}:
            raise bad(f"the {axis} axis has no {'alpha' if 'alpha' not in given else 'bandwidth'}; give alpha= and "
                      f"bandwidth= (for every axis) or start from a named profile; {_HELP}")
        links[axis] = replace(old, **given) if old else Link(given["alpha"], given["bandwidth"])
    if inter:
        old = fields.get("inter_node")
        if old is None and set(inter) != {"alpha", "bandwidth"}:
            raise bad(f"the link between nodes needs both inter.alpha= and inter.bandwidth=; {_HELP}")
        fields["inter_node"] = replace(old, **inter) if old else Link(inter["alpha"], inter["bandwidth"])
