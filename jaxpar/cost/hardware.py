"""The cost model: the price of a compiled step on a hardware profile (`jaxpar.cost.profile`).

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
"""
from __future__ import annotations

from jaxpar.cost import pricing
from jaxpar.cost.builtin_profiles import PROFILES  # noqa: F401 - jaxpar.cost.hardware.PROFILES, as documented
from jaxpar.cost.hardware_flag import parse_hardware  # noqa: F401 - jaxpar.cost.hardware.parse_hardware
from jaxpar.cost.hlo import collective_ops, loop_flops
from jaxpar.cost.profile import Link, Profile, check_profile  # noqa: F401 - the profile, as documented
from jaxpar.cost.profile_json import load_profile, save_profile  # noqa: F401 - jaxpar.cost.hardware.save_profile
from jaxpar.errors import OptionError
from jaxpar.runtime.resources import step_flops
from jaxpar.strategies.simulation import UNIT, StepCost  # noqa: F401 - the price of a step, as the strategies' clock reads it

BACKWARD_SHARE = 2 / 3  # the backward pass's share of a step's compute (2 of the 3 matmuls per layer)


def collective_seconds(op, profile: Profile) -> float:
    """Seconds of one `jaxpar.cost.hlo.Collective` on `profile` in one step (`jaxpar.cost.pricing`): one run's price
    times `op.runs`, the times it runs per step (an op in a pipeline's ticks runs every tick)."""
    return pricing.collective_seconds(op, profile)




def compiled_cost(compiled, mesh, profile: Profile, gradients: bool = True) -> StepCost:
    """The `StepCost` of a compiled step (`jax.stages.Compiled`) on `mesh`, priced on `profile`: loops counted as
    many times as they run (FLOPs and collectives; see the module docstring). `gradients`: the variant's exchange
    over the replica axis is a gradient average, which may overlap the backward pass (a meeting's parameter
    average runs after the step and cannot)."""
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
