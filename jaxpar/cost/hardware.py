"""Hardware profiles and the alpha-beta cost model that prices a compiled step on them.

A profile gives each device's peak FLOP/s and, per mesh axis, the link its collectives run over: a latency alpha
(seconds per message) and a bandwidth beta (bytes per second, one direction, per device). A step variant then costs

    compute = its per-device FLOPs / peak: XLA's cost analysis, which counts a while body once, with every loop
              body counted its trip count times (`jaxpar.cost.hlo.loop_flops`)
    comm    = the sum over the collectives it really contains (`jaxpar.cost.hlo.collective_ops`), each times the
              number of times it runs per step (the trip counts of the while loops around it: a pipeline's ticks,
              gradient accumulation), of
              all-reduce       2(g-1) alpha + 2(g-1)/g R / beta      (ring / bandwidth-optimal)
              all-gather        (g-1) alpha +  (g-1)/g R / beta
              reduce-scatter    (g-1) alpha +   (g-1)  R / beta      (R = the scattered result)
              all-to-all        (g-1) alpha +  (g-1)/g R / beta
              collective-permute     alpha +           R / beta
    with R the result bytes per device and g the group size, on the slowest link of the axes the group spans.

Compute and communication do not overlap in this model (an upper bound on a step; XLA may overlap some of it).
The numbers are a projection onto the profile's hardware, not a measurement of the machine the run is on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.errors import OptionError


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message
    bandwidth: float  # bytes per second, one direction, per device


@dataclass(frozen=True)
class Profile:
    name: str
    flops: float  # peak FLOP/s of one device
    links: dict = field(hash=False)  # mesh axis -> Link
    source: str = ""  # where the numbers come from
    memory: float | None = None  # bytes of one device's memory (None: the device's own, as jaxpar reads it)

    def link(self, axes) -> Link:
        """The slowest link among `axes` (a collective over several axes is as slow as its slowest one)."""
        links = [self.links[a] for a in axes if a in self.links] or list(self.links.values())
        return Link(max(x.alpha for x in links), min(x.bandwidth for x in links))

    def describe(self) -> str:
        parts = [f"{self.flops / 1e12:g} TFLOP/s per device"]
        if self.memory:
            parts.append(f"{self.memory / 1e9:g} GB of memory per device")
        for axis in mesh_lib.AXES:
            if axis in self.links:
                x = self.links[axis]
                parts.append(f"{axis}: alpha {x.alpha * 1e6:g} us, {x.bandwidth / 1e9:g} GB/s")
        return f"{self.name} ({'; '.join(parts)})"


_NVLINK = Link(5e-6, 300e9)
_IB100 = Link(10e-6, 12.5e9)
_ETH10 = Link(50e-6, 1.25e9)
_A100_PEAK = 312e12
_A100_MEMORY = 80e9
_NVLINK_SOURCE = ("A100 SXM 80GB datasheet: 312 TFLOP/s dense bf16 tensor-core peak, 80 GB HBM2e, NVLink 3 at "
                  "600 GB/s per GPU (300 GB/s each way)")
# alpha (latency) is an assumed order of magnitude, not a measurement: a few microseconds for an NVLink
# collective step, ~10 us for InfiniBand with its software stack, ~50 us for TCP over Ethernet.
PROFILES: dict[str, Profile] = {
    "a100-nvlink": Profile("a100-nvlink", _A100_PEAK, {a: _NVLINK for a in mesh_lib.AXES},
                           _NVLINK_SOURCE + "; every axis inside one 8-GPU NVSwitch node; alpha 5 us assumed",
                           _A100_MEMORY),
    # stage gets the data axis's link: both are the outer axes that cross nodes (mesh.AXES' order)
    "a100-ib100": Profile("a100-ib100", _A100_PEAK, {mesh_lib.DATA: _IB100, mesh_lib.STAGE: _IB100,
                                                     mesh_lib.FSDP: _NVLINK, mesh_lib.MODEL: _NVLINK},
                          _NVLINK_SOURCE + "; the data and stage axes cross nodes on 100 Gb/s InfiniBand (EDR: "
                          "12.5 GB/s per device); fsdp and model inside a node; alpha 10 us across nodes assumed",
                          _A100_MEMORY),
    "a100-eth10": Profile("a100-eth10", _A100_PEAK, {mesh_lib.DATA: _ETH10, mesh_lib.STAGE: _ETH10,
                                                     mesh_lib.FSDP: _NVLINK, mesh_lib.MODEL: _NVLINK},
                          _NVLINK_SOURCE + "; the data and stage axes cross nodes on 10 Gb/s Ethernet (1.25 GB/s "
                          "per device); fsdp and model inside a node; alpha 50 us (TCP) assumed", _A100_MEMORY),
}

_HELP = (f"expected a profile name ({', '.join(PROFILES)}) and/or comma-separated key=value items: flops=FLOP/s, "
         f"alpha=seconds, bandwidth=bytes/s, memory=bytes per device, or per axis AXIS.alpha / AXIS.bandwidth, e.g. "
         f"'flops=100e12,alpha=1e-5,bandwidth=12.5e9' or 'a100-nvlink,data.bandwidth=1.25e9'")


def parse_hardware(spec) -> Profile | None:
    """The `--hardware` flag: NAME, key=value items, or NAME followed by items that override it. None: no profile."""
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
        if items[0] not in PROFILES:
            raise bad(f"unknown profile {items[0]!r}; {_HELP}")
        base, items = PROFILES[items[0]], items[1:]
    flops = base.flops if base else None
    memory = base.memory if base else None
    links = dict(base.links) if base else {}
    every: dict = {}
    per_axis: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        try:
            number = float(value)
        except ValueError:
            raise bad(f"cannot read {item!r}; {_HELP}") from None
        if not sep or not math.isfinite(number) or number < 0 or (number == 0 and not key.endswith("alpha")):
            raise bad(f"{item!r}: the value must be a finite number > 0 (alpha may be 0); {_HELP}")
        axis, dot, what = key.rpartition(".")
        if key == "flops":
            flops = number
        elif key == "memory":
            memory = number
        elif not dot and key in ("alpha", "bandwidth"):
            every[key] = number
        elif dot and axis in mesh_lib.AXES and what in ("alpha", "bandwidth"):
            per_axis.setdefault(axis, {})[what] = number
        else:
            raise bad(f"unknown key {key!r}; {_HELP}")
    for axis in mesh_lib.AXES:
        old = links.get(axis)
        given = {**every, **per_axis.get(axis, {})}
        if old is None and set(given) != {"alpha", "bandwidth"}:
            raise bad(f"the {axis} axis has no {'alpha' if 'alpha' not in given else 'bandwidth'}; give alpha= and "
                      f"bandwidth= (for every axis) or start from a named profile; {_HELP}")
        links[axis] = replace(old, **given) if old else Link(given["alpha"], given["bandwidth"])
    if flops is None:
        raise bad(f"no flops= (peak FLOP/s per device) given; {_HELP}")
    name = text if base is None or items else base.name
    source = (base.source + ("; overridden: " + ", ".join(items) if items else "")) if base else "given on the command line"
    return Profile(name, flops, links, source, memory)


def collective_seconds(op, profile: Profile) -> float:
    """Alpha-beta seconds of one `jaxpar.cost.hlo.Collective` on `profile` in one step (see the module docstring):
    one run's price times `op.runs`, the times it runs per step (an op in a pipeline's ticks runs every tick)."""
    g, r = op.group, op.bytes
    if op.kind != "collective-permute" and g <= 1:
        return 0.0
    link = profile.link(op.axes or ())
    alpha, beta = link.alpha, link.bandwidth
    if op.kind == "collective-permute":
        once = alpha + r / beta
    elif op.kind == "all-reduce":
        once = 2 * (g - 1) * alpha + 2 * (g - 1) / g * r / beta
    elif op.kind == "reduce-scatter":
        once = (g - 1) * alpha + (g - 1) * r / beta
    else:  # all-gather, all-to-all
        once = (g - 1) * alpha + (g - 1) / g * r / beta
    return once * getattr(op, "runs", 1)


class StepCost(NamedTuple):
    """Simulated seconds of one step variant: a full-speed replica's compute, and the variant's collectives."""

    compute: float = 1.0
    comm: float = 0.0


UNIT = StepCost()  # no profile: one unit of compute per step, communication free (sim_time = the step count)


def compiled_cost(compiled, mesh, profile: Profile) -> StepCost:
    """The `StepCost` of a compiled step (`jax.stages.Compiled`) on `mesh`, priced on `profile`: loops counted as
    many times as they run (FLOPs and collectives; see the module docstring)."""
    from jaxpar.cost.hlo import collective_ops, loop_flops
    from jaxpar.runtime.resources import step_flops

    return step_cost(loop_flops(compiled, step_flops(compiled)).per_device, collective_ops(compiled, mesh), profile)


def step_cost(flops_per_device: float | None, collectives, profile: Profile) -> StepCost:
    """The `StepCost` of a compiled step variant on `profile`."""
    if not flops_per_device:
        raise OptionError("hardware", profile.name, "this backend gives no FLOP count for the compiled step (XLA "
                          "cost analysis), so the cost model cannot price it; run without --hardware")
    return StepCost(flops_per_device / profile.flops, sum(collective_seconds(op, profile) for op in collectives))
