"""The links of a mesh axis: each collective kind timed over a sweep of message sizes, and the alpha (seconds per
message step) and beta (bytes per second) of the least-squares line through the sweep.

What is timed: each collective over one mesh axis (the others are independent groups running at the same time), a
chain inside a loop, so a trip cannot start before the previous one ended and XLA cannot hoist it: all-reduce
`x = psum(x)`; collective-permute `x = ppermute(x)` (a ring shift); all-gather `c = all_gather(c)[:chunk]`;
reduce-scatter `x[:chunk] = psum_scatter(x)` (an in-place update of the carry). The buffers hold zeros (sums stay
finite; XLA:CPU's speed does not depend on the values). Each is timed by `jaxpar.calibration.timing.time_loop`.

The line. The cost model prices a collective of r bytes over a group of g as `steps(g) x alpha + factor(g) x r /
bandwidth` (`jaxpar.cost.hardware.collective_seconds`, read here by pricing the op on unit links, so the line and
the model cannot disagree about the formulas). A least-squares line `seconds = c0 + c1 x r` through the sweep
(weighted by 1 / seconds: relative residuals) gives alpha = c0 / steps and bandwidth = factor / c1; its relative RMS
and worst residual are reported. A negative intercept (the sweep cannot tell a latency below its noise) is taken as
alpha = 0 and said.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpar.calibration.timing import per_device, time_loop
from jaxpar.cost.hardware import collective_seconds
from jaxpar.cost.hlo import Collective
from jaxpar.cost.profile import Link, Profile

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")
SIZES = tuple(4 ** k * 1024 for k in range(1, 7))  # 4 KiB .. 4 MiB per device: latency- to bandwidth-bound


def coefficients(kind: str, group: int) -> tuple[float, float]:
    """(steps, factor) of the cost model's price of `kind` over `group` devices: seconds = steps x alpha + factor x
    r / bandwidth, for r the result bytes per device."""

    def priced(link) -> float:
        op = Collective(kind, 1, group, None, pairs=((0, 1),) if kind == "collective-permute" else ())
        return collective_seconds(op, Profile("unit", 1.0, {None: link}))

    return priced(Link(1.0, math.inf)), priced(Link(0.0, 1.0))


def least_squares_line(sizes, seconds) -> dict:
    """Least-squares `seconds = intercept + slope x bytes` minimising relative residuals (the sizes span decades:
    plain least squares would follow the largest and leave the latency to chance), with the relative RMS and worst
    residual."""
    x, y = np.asarray(sizes, float), np.asarray(seconds, float)
    slope, intercept = np.polyfit(x, y, 1, w=1.0 / y)
    predicted = intercept + slope * x
    relative = (predicted - y) / y
    return {"intercept": float(intercept), "slope": float(slope),
            "rms_relative_error": float(np.sqrt(np.mean(relative ** 2))),
            "worst_relative_error": float(np.max(np.abs(relative)))}


def link_from_line(kind: str, group: int, line: dict, sizes=None, seconds=None) -> dict:
    """alpha and bandwidth of `kind` over `group` from its least-squares line (see the module docstring). A line
    that does not rise (the sweep's times are all latency, or noise) bounds the bandwidth instead: the largest
    message's time taken as all transfer, and alpha from the smallest message. Never raises: with several processes
    each reads its own times, and a process that stopped alone would leave the others waiting in a collective."""
    steps, factor = coefficients(kind, group)
    if line["slope"] <= 0 and sizes is not None:
        alpha = min(seconds) / steps if steps else 0.0
        return {"alpha": alpha, "bandwidth": factor * max(sizes) / max(seconds),
                "note": "time did not grow with the message size: bandwidth is a lower bound from the largest "
                        "message, alpha the smallest message's time"}
    alpha = max(line["intercept"], 0.0) / steps if steps else 0.0
    note = "negative intercept: alpha taken as 0" if line["intercept"] < 0 else ""
    return {"alpha": alpha, "bandwidth": factor / line["slope"] if line["slope"] > 0 else math.inf, "note": note}


def collective_seconds_measured(mesh, axis: str, kind: str, nbytes: int, trips: int = 8, repeats: int = 3) -> float:
    """Measured seconds of one `kind` over mesh `axis` whose result is `nbytes` per device (module docstring)."""
    g = mesh.shape[axis]
    if kind == "reduce-scatter":
        nbytes *= g  # `nbytes` is the result, one of g chunks of the input
    elements = max(nbytes // 4 // g * g, g)
    x, spec = per_device(mesh, (elements,), jnp.float32)
    perm = [(i, (i + 1) % g) for i in range(g)]
    chunk = elements // g

    def gather(c):
        return lax.all_gather(c, axis, tiled=True)

    bodies = {
        "all-reduce": lambda y: lax.psum(y, axis),
        "collective-permute": lambda y: lax.ppermute(y, axis, perm),
        "all-gather": lambda y: gather(y[:chunk])[: elements],  # result: the gathered `elements`
        # result: one chunk, written back in place over the carry's first chunk (a chunk's copy, no more)
        "reduce-scatter": lambda y: lax.dynamic_update_slice(y, lax.psum_scatter(y, axis, tiled=True), (0,)),
    }
    body = bodies[kind]

    def build(k):
        def local(y):
            return lax.fori_loop(0, k, lambda _, z: body(z), y)

        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))

    return time_loop(build, (x,), trips, repeats)


def calibrate_axis(mesh, axis: str, kinds=KINDS, sizes=SIZES, trips: int = 8, repeats: int = 3,
                   measure=None, progress=None) -> dict:
    """Per collective kind over `axis`: the sweep (bytes, seconds), its least-squares line and the link it gives.
    `measure(axis, kind, nbytes) -> seconds` replaces the real measurement (tests use a known answer)."""
    measure = measure or (lambda a, k, b: collective_seconds_measured(mesh, a, k, b, trips, repeats))
    group = mesh.shape[axis]
    out = {}
    for kind in kinds:
        seconds = []
        for nbytes in sizes:
            seconds.append(measure(axis, kind, nbytes))
            if progress:
                progress(f"{kind} over {axis} (g={group}), {nbytes:,} bytes: {seconds[-1] * 1e6:,.1f} us")
        line = least_squares_line(sizes, seconds)
        out[kind] = {"bytes": list(sizes), "seconds": seconds, "fit": line,
                     **link_from_line(kind, group, line, sizes, seconds)}
    return out


def crosses_processes(mesh, axis: str) -> bool:
    """Whether some group of devices along `axis` holds devices of more than one process."""
    devices = np.moveaxis(mesh.devices, list(mesh.axis_names).index(axis), -1)
    return any(len({d.process_index for d in group}) > 1 for group in devices.reshape(-1, devices.shape[-1]))
