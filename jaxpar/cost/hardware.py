"""Hardware profiles and the cost model that prices a compiled step on them.

A profile gives each device's peak and sustained FLOP/s and, per mesh axis, the link its collectives run over: a
latency alpha (seconds per message) and a bandwidth beta (bytes per second, one direction, per device). It may add
nodes: devices per node, the link between nodes (per NIC) and the NICs a node's devices share; the native
all-reduce's algorithm over nodes (ring or hierarchical); whether the gradient all-reduce overlaps the backward pass
(and its bucket); and the dtype of gradients on the wire. A calibrated profile may give a collective kind its own
links (`kinds`: on XLA:CPU a permute's latency is several times an all-reduce's) and name the model whose step its
`sustained` and `launch` were measured on (`model`). A step variant then costs

    compute = its per-device FLOPs / sustained FLOP/s: XLA's cost analysis, with every loop body counted its trip
              count times (`jaxpar.cost.hlo.loop_flops`)
    comm    = the sum over the collectives it really contains (`jaxpar.cost.hlo.collective_ops`), each times the
              number of times it runs per step, of its price (`jaxpar.cost.pricing`: the alpha-beta formulas, over
              nodes as the algorithm runs)
    overlap = with `overlap` on, for a variant whose exchange is a gradient average: the part of the native
              gradient all-reduce that runs during the backward pass (`overlapped`), so that
              step = compute + comm - overlap = forward + max(backward, G - tail) + tail + the other collectives

The numbers are a projection onto the profile's hardware, not a measurement of the machine the run is on.

Why about 300 lines: the profile, its `--hardware` parser and the step pricing are one contract (a field added to the
profile is parsed and priced here); the formulas over nodes live in `pricing.py`, the JSON file in `profile_json.py`.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace

from jaxpar.cost import pricing
from jaxpar.cost.profile_json import NATIVE_ALLREDUCES, check_profile, load_profile, save_profile  # noqa: F401
from jaxpar.errors import OptionError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.strategies.simulation import StepCost  # the price of a step, as the strategies' clock reads it

BACKWARD_SHARE = 2 / 3  # the backward pass's share of a step's compute (2 of the 3 matmuls per layer)
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
    # on this machine with every device busy (jaxpar.cost.codec_calibration); empty: codecs priced by FLOPs
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
        from jaxpar.cost.profile_json import profile_from_dict
        return profile_from_dict(data)


_NVLINK = Link(5e-6, 300e9)
_IB100 = Link(10e-6, 12.5e9)
_ETH10 = Link(50e-6, 1.25e9)
_A100_PEAK = 312e12
# Narayanan et al. 2021 (Megatron-LM, "Efficient Large-Scale Language Model Training on GPU Clusters", SC21): 502
# PFLOP/s on 3072 A100s, 52% of peak, i.e. 163 TFLOP/s per GPU on a 1T-parameter GPT: a published sustained figure
# for a well-tuned large model; small models sustain less.
_A100_SUSTAINED = 163e12
_A100_MEMORY = 80e9
_NVLINK_SOURCE = ("A100 SXM 80GB datasheet: 312 TFLOP/s dense bf16 tensor-core peak, 80 GB HBM2e, NVLink 3 at "
                  "600 GB/s per GPU (300 GB/s each way); sustained 163 TFLOP/s: Narayanan et al. 2021 (Megatron-LM, "
                  "502 PFLOP/s on 3072 A100s, 52% of peak)")
# alpha (latency) is an assumed order of magnitude, not a measurement: a few microseconds for an NVLink
# collective step, ~10 us for InfiniBand with its software stack, ~50 us for TCP over Ethernet.
PROFILES: dict[str, Profile] = {
    "a100-nvlink": Profile("a100-nvlink", _A100_PEAK, {a: _NVLINK for a in mesh_lib.AXES},
                           _NVLINK_SOURCE + "; every axis inside one 8-GPU NVSwitch node; alpha 5 us assumed",
                           _A100_MEMORY, _A100_SUSTAINED),
    # stage gets the data axis's link: both are the outer axes that cross nodes (mesh.AXES' order)
    "a100-ib100": Profile("a100-ib100", _A100_PEAK, {mesh_lib.DATA: _IB100, mesh_lib.STAGE: _IB100,
                                                     mesh_lib.FSDP: _NVLINK, mesh_lib.MODEL: _NVLINK},
                          _NVLINK_SOURCE + "; the data and stage axes cross nodes on 100 Gb/s InfiniBand (EDR: "
                          "12.5 GB/s per device); fsdp and model inside a node; alpha 10 us across nodes assumed",
                          _A100_MEMORY, _A100_SUSTAINED),
    "a100-eth10": Profile("a100-eth10", _A100_PEAK, {mesh_lib.DATA: _ETH10, mesh_lib.STAGE: _ETH10,
                                                     mesh_lib.FSDP: _NVLINK, mesh_lib.MODEL: _NVLINK},
                          _NVLINK_SOURCE + "; the data and stage axes cross nodes on 10 Gb/s Ethernet (1.25 GB/s "
                          "per device); fsdp and model inside a node; alpha 50 us (TCP) assumed", _A100_MEMORY,
                          _A100_SUSTAINED),
    # DGX A100: 8 GPUs on NVSwitch, 8 ConnectX-6 HDR 200 Gb/s InfiniBand NICs for compute (25 GB/s each)
    "dgx-a100": Profile("dgx-a100", _A100_PEAK, {a: _NVLINK for a in mesh_lib.AXES},
                        _NVLINK_SOURCE + "; DGX A100 datasheet: 8 GPUs per node, 8 x 200 Gb/s HDR InfiniBand NICs "
                        "(25 GB/s each); alpha 5 us inside a node and 10 us between nodes assumed", _A100_MEMORY,
                        _A100_SUSTAINED, devices_per_node=8, inter_node=Link(10e-6, 25e9), nics_per_node=8),
}

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
    None: no profile."""
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
    fields = {f: getattr(base, f) for f in Profile.__dataclass_fields__} if base else {"name": text, "flops": None}
    fields["links"] = dict(base.links) if base else {}
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
    links = fields["links"]
    for axis in mesh_lib.AXES:
        old = links.get(axis)
        given = {**every, **per_axis.get(axis, {})}
        if old is None and set(given) != {"alpha", "bandwidth"}:
            raise bad(f"the {axis} axis has no {'alpha' if 'alpha' not in given else 'bandwidth'}; give alpha= and "
                      f"bandwidth= (for every axis) or start from a named profile; {_HELP}")
        links[axis] = replace(old, **given) if old else Link(given["alpha"], given["bandwidth"])
    if inter:
        old = fields.get("inter_node")
        if old is None and set(inter) != {"alpha", "bandwidth"}:
            raise bad(f"the link between nodes needs both inter.alpha= and inter.bandwidth=; {_HELP}")
        fields["inter_node"] = replace(old, **inter) if old else Link(inter["alpha"], inter["bandwidth"])
    if fields["flops"] is None:
        raise bad(f"no flops= (peak FLOP/s per device) given; {_HELP}")
    fields["name"] = text if base is None or items else base.name
    fields["source"] = ((base.source + ("; overridden: " + ", ".join(items) if items else "")) if base
                        else "given on the command line")
    try:
        return check_profile(Profile(**fields))
    except ValueError as error:
        raise bad(f"{error}; {_HELP}") from None


def collective_seconds(op, profile: Profile) -> float:
    """Seconds of one `jaxpar.cost.hlo.Collective` on `profile` in one step (`jaxpar.cost.pricing`): one run's price
    times `op.runs`, the times it runs per step (an op in a pipeline's ticks runs every tick)."""
    return pricing.collective_seconds(op, profile)


def compiled_cost(compiled, mesh, profile: Profile, gradients: bool = True) -> StepCost:
    """The `StepCost` of a compiled step (`jax.stages.Compiled`) on `mesh`, priced on `profile`: loops counted as
    many times as they run (FLOPs and collectives; see the module docstring). `gradients`: the variant's exchange
    over the replica axis is a gradient average, which may overlap the backward pass (a meeting's parameter
    average runs after the step and cannot)."""
    from jaxpar.cost.hlo import collective_ops, loop_flops
    from jaxpar.runtime.resources import step_flops

    return step_cost(loop_flops(compiled, step_flops(compiled)).per_device, collective_ops(compiled, mesh), profile,
                     gradients)


def overlapped(compute: float, collectives, profile: Profile) -> float:
    """Seconds of the native gradient all-reduce hidden under the backward pass (0 with `profile.overlap` off).

    The bucket assumption: the backward pass is BACKWARD_SHARE of the compute, and hands its gradients to the
    all-reduce in buckets as they become ready; every bucket but the last can run while the backward pass goes on,
    the last (`profile.bucket` bytes on the wire, or the whole gradient if smaller) only after it. With G the
    gradient all-reduce's seconds and T the last bucket's, the hidden part is min(backward, G - T), so
    step = forward + max(backward, G - T) + T + the other collectives. Only the compiler's own all-reduce /
    reduce-scatter over the replica axis counts: the hand-written algorithms (ring, torus2d, ps) fuse every
    gradient into one buffer after the backward pass, so nothing of theirs overlaps."""
    if not profile.overlap:
        return 0.0
    native = [op for op in collectives if pricing.gradient_exchange(op) and op.kind in ("all-reduce",
                                                                                        "reduce-scatter")]
    if not native:
        return 0.0
    gradient = sum(collective_seconds(op, profile) for op in native)
    largest = max(native, key=lambda op: op.bytes)
    bucket = profile.bucket * 4 / pricing.WIRE_BYTES[profile.wire]  # the compiled bytes are float32
    tail = collective_seconds(largest._replace(bytes=min(largest.bytes, bucket), runs=1), profile)
    return max(0.0, min(BACKWARD_SHARE * compute, gradient - tail))


def step_cost(flops_per_device: float | None, collectives, profile: Profile, gradients: bool = True) -> StepCost:
    """The `StepCost` of a compiled step variant on `profile`."""
    if not flops_per_device:
        raise OptionError("hardware", profile.name, "this backend gives no FLOP count for the compiled step (XLA "
                          "cost analysis), so the cost model cannot price it; run without --hardware")
    compute = flops_per_device / profile.compute_flops + profile.launch
    comm = sum(collective_seconds(op, profile) for op in collectives)
    return StepCost(compute, comm, overlapped(compute, collectives, profile) if gradients else 0.0)
