"""A hardware profile: `Profile` and its `Link`s, the checks every profile passes, and its JSON form
(`Profile.to_dict` / `Profile.from_dict`, what `--hardware PATH.json` loads and `python -m jaxpar.calibrate` writes).

    {"name": "...", "flops": 312e12, "sustained": 163e12, "memory": 80e9,
     "links": {"data": {"alpha": 1e-5, "bandwidth": 12.5e9}, ...},          (mesh axis -> link inside a node)
     "devices_per_node": 8, "inter_node": {"alpha": 1e-5, "bandwidth": 25e9}, "nics_per_node": 8,
     "allreduce": "ring", "overlap": false, "bucket": 25e6, "wire": "float32", "source": "...",
     "launch": 5.5e-5, "kinds": {"collective-permute": {"data": {"alpha": 1.5e-4, "bandwidth": 1e9}}},
     "model": "mlp",                              (a kind's own links; the model sustained and launch came from)
     "codecs": {"int8": {"seconds_per_element": 2e-9, "flops_per_element": 34, "replicas": 8}}}
                                                  (a codec's compute measured here, jaxpar.calibration.codecs)
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from jaxpar.cost import pricing
from jaxpar.parallel import mesh as mesh_lib

MEASUREMENTS = "calibration"  # the field where python -m jaxpar.calibrate keeps its sweeps and fits
NATIVE_ALLREDUCES = ("ring", "hierarchical")  # how the compiler's all-reduce runs over nodes (jaxpar.cost.pricing)
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DEFAULT_BUCKET = 25e6  # bytes per gradient bucket: PyTorch DDP's bucket_cap_mb default (25 MB)


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message
    bandwidth: float  # bytes per second, one direction, per device (between nodes: per NIC)


@dataclass(frozen=True)
class Profile:
    name: str
    flops: float  # peak FLOP/s of one device
    links: dict = field(hash=False)  # mesh axis -> Link (with nodes: the link inside a node)
    source: str = ""  # where the numbers come from
    memory: float | None = None  # bytes of one device's memory (None: the device's own, as jaxpar reads it)
    sustained: float | None = None  # FLOP/s one device sustains on a training step (None: the peak); compute uses it
    devices_per_node: int | None = None  # None: no nodes, every hop of an axis on its link
    inter_node: Link | None = None  # the link between nodes, per NIC
    nics_per_node: int = 1  # NICs a node's devices share for the hops that leave it
    allreduce: str = "ring"  # the native all-reduce over nodes: "ring" or "hierarchical" (see jaxpar.cost.pricing)
    overlap: bool = False  # the gradient all-reduce overlaps the backward pass (False: the no-overlap bound)
    bucket: float = DEFAULT_BUCKET  # bytes on the wire of the last gradient bucket, the tail that cannot overlap
    wire: str = "float32"  # dtype of gradients on the wire (pricing.WIRE_BYTES)
    # seconds every step pays whatever its size: an empty program's launch, or with `model` that model's measured
    # fixed cost per step (calibrated; 0: not priced)
    launch: float = 0.0
    # collective kind -> mesh axis -> Link: a kind's own measured link, where it differs from `links` (calibrated:
    # on XLA:CPU a collective-permute costs several times an all-reduce's latency); empty: `links` for every kind
    kinds: dict = field(default_factory=dict, hash=False)
    model: str | None = None  # the model whose training step gave `sustained` and `launch` (None: a matmul loop)
    # gradient codec name -> {"seconds_per_element", "flops_per_element", "replicas"}: its encode + decode measured
    # on this machine with every device busy (jaxpar.calibration.codecs); empty: codecs priced by FLOPs
    codecs: dict = field(default_factory=dict, hash=False)

    @property
    def compute_flops(self) -> float:
        """The FLOP/s compute is priced at: sustained if stated, else the peak."""
        return self.sustained or self.flops

    def link(self, axes, kind: str | None = None) -> Link:
        """The slowest link among `axes` (a collective over several axes is as slow as its slowest one); with
        `kind`, that collective kind's own links where the profile has them (`kinds`)."""
        table = self.kinds.get(kind) or self.links
        links = ([table[a] for a in axes if a in table] or [self.links[a] for a in axes if a in self.links]
                 or list(self.links.values()))
        return Link(max(x.alpha for x in links), min(x.bandwidth for x in links))

    def describe(self) -> str:
        parts = [f"{self.flops / 1e12:g} TFLOP/s peak per device"]
        if self.sustained:
            parts.append(f"{self.sustained / 1e12:g} sustained")
        if self.memory:
            parts.append(f"{self.memory / 1e9:g} GB of memory per device")
        if self.launch:
            parts.append(f"{self.launch * 1e6:g} us to launch a step" + (f" ({self.model}'s fixed cost per step)"
                                                                          if self.model else ""))
        if self.model:
            parts.append(f"sustained and launch measured on {self.model}'s training step")
        if self.kinds:
            parts.append(f"own links for {', '.join(sorted(self.kinds))}")
        if self.codecs:
            parts.append(f"codec compute measured for {', '.join(sorted(self.codecs))}")
        inside = " inside a node" if self.devices_per_node else ""
        for axis in mesh_lib.AXES:
            if axis in self.links:
                x = self.links[axis]
                parts.append(f"{axis}{inside}: alpha {x.alpha * 1e6:g} us, {x.bandwidth / 1e9:g} GB/s")
        if self.devices_per_node and self.inter_node:
            x = self.inter_node
            parts.append(f"{self.devices_per_node} devices per node sharing {self.nics_per_node} NIC(s) of alpha "
                         f"{x.alpha * 1e6:g} us, {x.bandwidth / 1e9:g} GB/s between nodes; native all-reduce "
                         f"{self.allreduce}")
        parts.append(f"overlap {'on' if self.overlap else 'off'}" + (f" (bucket {self.bucket / 1e6:g} MB)"
                                                                     if self.overlap else ""))
        if self.wire != "float32":
            parts.append(f"gradients sent as {self.wire}")
        return f"{self.name} ({'; '.join(parts)})"

    def to_dict(self) -> dict:
        """The profile as plain JSON values (`from_dict` reads it back; `--hardware FILE.json` loads it)."""
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> "Profile":
        """A profile from `to_dict`'s form; a missing or malformed field raises ValueError naming it."""
        return profile_from_dict(data)


def profile_from_dict(data: dict) -> Profile:
    """A `Profile` from its `to_dict` form; a missing or malformed field raises ValueError naming it."""
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


def check_profile(profile: Profile) -> Profile:
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
