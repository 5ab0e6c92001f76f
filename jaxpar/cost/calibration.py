"""Measuring the machine at hand for the cost model: sustained matmul FLOP/s per device, and per mesh axis the
alpha (seconds per message step) and beta (bytes per second) of each collective, fitted by least squares.

What is timed. Every program runs on all devices of the mesh at once, as a training step does: on XLA:CPU the
emulated devices share the machine's cores, so a device's FLOP/s is what it gets while the others work too.
- Matmul: each device multiplies its own n x n float32 matrices (no communication) inside a loop of K trips;
  FLOP/s per device = 2 n^3 K / seconds.
- Collectives over one mesh axis (the others are independent groups running at the same time), each a chain inside
  a loop, so a trip cannot start before the previous one ended and XLA cannot hoist it:
  all-reduce `x = psum(x)`; collective-permute `x = ppermute(x)` (a ring shift); all-gather
  `c = all_gather(c)[:chunk]`; reduce-scatter `x[:chunk] = psum_scatter(x)` (an in-place update of the carry).
  The buffers hold zeros (sums stay finite; XLA:CPU's speed does not depend on the values).
- Each program is timed at K = 1 and K = 1 + N trips (the fastest of a few calls each); the difference over N is one
  trip: program launch, dispatch and the loop's own entry cancel out.

Fitting. The cost model prices a collective of r bytes over a group of g as `steps(g) x alpha + factor(g) x r /
bandwidth` (`jaxpar.cost.hardware.collective_seconds`, read here by pricing the op on unit links, so the fit and
the model cannot disagree about the formulas). A least-squares line `seconds = c0 + c1 x r` through the sweep of
sizes (weighted by 1 / seconds: relative residuals) gives alpha = c0 / steps and bandwidth = factor / c1; the fit's relative RMS and worst residual are
reported. A negative intercept (the sweep cannot tell a latency below its noise) is taken as alpha = 0 and said.

`calibrate(...)` returns a plain dict (JSON-ready); `python -m jaxpar.calibrate` (`jaxpar/calibrate.py`, the
command line) writes it to a file that `--hardware FILE` reads.

Why about 340 lines: the timed programs, the fit that reads the cost model's own formulas and the profile they make
are one measurement; the command line, a model's own step (`model_step.py`) and the codecs' timing
(`codec_calibration.py`) already live apart.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import numpy as np

from jaxpar.cost.profile_json import MEASUREMENTS
from jaxpar.errors import ConfigError

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")
SIZES = tuple(4 ** k * 1024 for k in range(1, 7))  # 4 KiB .. 4 MiB per device: latency- to bandwidth-bound
MATMUL_SIZES = (128, 256, 512)  # the default transformer's matmuls are 128-512 wide per device
# trips adding less than this share of the 1-trip call are noise: N real ops take more than N / 800 of a launch
NOISE = 0.01
# the link kind the profile's single link per axis comes from: gradients are all-reduced
PROFILE_KIND = "all-reduce"


# --- the model's formulas, read from the cost model itself -----------------------------------------------------------
def coefficients(kind: str, group: int) -> tuple[float, float]:
    """(steps, factor) of the cost model's price of `kind` over `group` devices: seconds = steps x alpha + factor x
    r / bandwidth, for r the result bytes per device."""
    from jaxpar.cost.hardware import Link, Profile, collective_seconds
    from jaxpar.cost.hlo import Collective

    def priced(link) -> float:
        op = Collective(kind, 1, group, None, pairs=((0, 1),) if kind == "collective-permute" else ())
        return collective_seconds(op, Profile("unit", 1.0, {None: link}))

    return priced(Link(1.0, math.inf)), priced(Link(0.0, 1.0))


def fit_line(sizes, seconds) -> dict:
    """Least-squares `seconds = intercept + slope x bytes` minimising relative residuals (the sizes span decades:
    plain least squares would fit the largest and leave the latency to chance), with the relative RMS and worst
    residual."""
    x, y = np.asarray(sizes, float), np.asarray(seconds, float)
    slope, intercept = np.polyfit(x, y, 1, w=1.0 / y)
    predicted = intercept + slope * x
    relative = (predicted - y) / y
    return {"intercept": float(intercept), "slope": float(slope),
            "rms_relative_error": float(np.sqrt(np.mean(relative ** 2))),
            "worst_relative_error": float(np.max(np.abs(relative)))}


def link_from_fit(kind: str, group: int, fit: dict, sizes=None, seconds=None) -> dict:
    """alpha and bandwidth of `kind` over `group` from its fitted line (see the module docstring). A line that does
    not rise (the sweep's times are all latency, or noise) bounds the bandwidth instead: the largest message's
    time taken as all transfer, and alpha from the smallest message. Never raises: with several processes each
    fits its own times, and a process that stopped alone would leave the others waiting in a collective."""
    steps, factor = coefficients(kind, group)
    if fit["slope"] <= 0 and sizes is not None:
        alpha = min(seconds) / steps if steps else 0.0
        return {"alpha": alpha, "bandwidth": factor * max(sizes) / max(seconds),
                "note": "time did not grow with the message size: bandwidth is a lower bound from the largest "
                        "message, alpha the smallest message's time"}
    alpha = max(fit["intercept"], 0.0) / steps if steps else 0.0
    note = "negative intercept: alpha taken as 0" if fit["intercept"] < 0 else ""
    return {"alpha": alpha, "bandwidth": factor / fit["slope"] if fit["slope"] > 0 else math.inf, "note": note}


# --- measuring ---------------------------------------------------------------------------------------------------
def time_loop(build: Callable[[int], Callable], args, trips: int, repeats: int) -> float:
    """Seconds of one trip of the loop program `build(K)` (a jitted function of `args` looping K times):
    (fastest call at 1 + trips) - (fastest call at 1), over trips. The fastest of the repeats, not the median: what
    other work on the machine adds is noise, never the link's own cost. A difference below NOISE of the 1-trip call (noise
    larger than the trips' work) gives the longer call over its trips instead, an upper bound."""
    import jax

    def fastest(k: int) -> float:
        fn = build(k)
        jax.block_until_ready(fn(*args))  # compile and warm up
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - started)
        return min(times)

    longer, shorter = fastest(1 + trips), fastest(1)
    if longer - shorter > NOISE * shorter:
        return (longer - shorter) / trips
    # the trips took no measurable time beyond the noise (a loaded machine): the whole longer program per trip,
    # launch included, bounds one trip from above (never a near-zero time, which would be absurd FLOP/s)
    return longer / (1 + trips)


def _per_device(mesh, shape, dtype):
    """A zero array with one `shape` block per device (every mesh axis splits the leading dimension)."""
    import jax
    import jax.numpy as jnp

    from jaxpar.parallel import partitioning as shd

    sharding = shd.leading_over_devices(mesh)
    full = (mesh.size * shape[0],) + tuple(shape[1:])
    return jax.device_put(jnp.zeros(full, dtype), sharding), sharding.spec


def matmul_flops(mesh, n: int, trips: int = 8, repeats: int = 3) -> float:
    """Sustained float32 FLOP/s of one device multiplying n x n matrices while every device does the same."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    a, spec = _per_device(mesh, (n, n), jnp.float32)

    def build(k):
        def local(x):
            return lax.fori_loop(0, k, lambda _, y: jnp.dot(y, x) * 0.5, x)

        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec))

    return 2 * n ** 3 / time_loop(build, (a,), trips, repeats)


def collective_seconds_measured(mesh, axis: str, kind: str, nbytes: int, trips: int = 8, repeats: int = 3) -> float:
    """Measured seconds of one `kind` over mesh `axis` whose result is `nbytes` per device (module docstring)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    g = mesh.shape[axis]
    if kind == "reduce-scatter":
        nbytes *= g  # `nbytes` is the result, one of g chunks of the input
    elements = max(nbytes // 4 // g * g, g)
    x, spec = _per_device(mesh, (elements,), jnp.float32)
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
    """Per collective kind over `axis`: the sweep (bytes, seconds), the fitted line and the link it gives.
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
        fit = fit_line(sizes, seconds)
        out[kind] = {"bytes": list(sizes), "seconds": seconds, "fit": fit,
                     **link_from_fit(kind, group, fit, sizes, seconds)}
    return out


def matmul(mesh, sizes=MATMUL_SIZES, trips: int = 8, repeats: int = 3, progress=None) -> dict:
    """Sustained FLOP/s per device at each matmul size, and their median (the profile's number)."""
    measured = {}
    for n in sizes:
        measured[str(n)] = matmul_flops(mesh, n, trips, repeats)
        if progress:
            progress(f"matmul {n} x {n} float32: {measured[str(n)] / 1e9:,.2f} GFLOP/s per device")
    return {"per_size": measured, "flops": statistics.median(measured.values())}


def launch_seconds(mesh, repeats: int = 30) -> float:
    """Seconds to start a program on every device of the mesh and see it end: the fastest of `repeats` calls of a
    one-element add per device (each call waited for), what every step pays whatever its size."""
    import jax
    import jax.numpy as jnp

    x, spec = _per_device(mesh, (1,), jnp.float32)
    fn = jax.jit(jax.shard_map(lambda y: y + 1, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.block_until_ready(fn(x))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        x = jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - started)
    return min(times)


def crosses_processes(mesh, axis: str) -> bool:
    """Whether some group of devices along `axis` holds devices of more than one process."""
    devices = np.moveaxis(mesh.devices, list(mesh.axis_names).index(axis), -1)
    return any(len({d.process_index for d in group}) > 1 for group in devices.reshape(-1, devices.shape[-1]))


def calibrate(mesh, kinds=KINDS, sizes=SIZES, matmul_sizes=MATMUL_SIZES, trips: int = 8, repeats: int = 3,
              progress=None, measure=None, flops=None, codecs=None, measure_codec=None) -> dict:
    """Measures `mesh`: matmul FLOP/s, and every axis of size > 1 (see the module docstring). Returns the profile
    as a JSON-ready dict: `flops`, per axis of the mesh's roles a link (`alpha`, `bandwidth`, from the all-reduce
    fit), `memory`, `source`, and under `calibration` every measurement and fit. An axis of size 1 cannot be
    measured: it gets the measured link of the slowest measured axis, said in `source`. `measure` / `flops`
    replace the measurements (tests)."""
    import platform

    import jax

    from jaxpar.parallel import mesh as mesh_lib
    from jaxpar.runtime.resources import device_memory

    measured_axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    if not measured_axes:
        raise ConfigError(f"mesh {mesh_lib.shape_line(mesh)}: no axis has more than one device, so no link can be "
                          f"measured; use a mesh over 2 or more devices (e.g. --mesh {len(jax.devices())})")
    compute = {"flops": flops, "per_size": {}} if flops is not None else matmul(mesh, matmul_sizes, trips, repeats,
                                                                               progress)
    launch = 0.0 if flops is not None else launch_seconds(mesh)
    if progress:
        progress(f"launching a program on {mesh.size} devices: {launch * 1e6:,.1f} us")
    from jaxpar.cost import codec_calibration

    timed_codecs = {} if flops is not None and measure_codec is None else codec_calibration.calibrate_codecs(
        mesh, codec_calibration.CODECS if codecs is None else codecs, trips=trips, repeats=repeats,
        measure=measure_codec, progress=progress)
    axes = {}
    for axis in measured_axes:
        axes[axis] = calibrate_axis(mesh, axis, kinds, sizes, trips, repeats, measure, progress)
        axes[axis]["crosses_processes"] = crosses_processes(mesh, axis)
        axes[axis]["group"] = mesh.shape[axis]
    link_kind = PROFILE_KIND if PROFILE_KIND in kinds else kinds[0]
    fitted = {a: {"alpha": axes[a][link_kind]["alpha"], "bandwidth": axes[a][link_kind]["bandwidth"]}
              for a in measured_axes}
    inside = [a for a in measured_axes if not axes[a]["crosses_processes"]] or measured_axes
    across = [a for a in measured_axes if axes[a]["crosses_processes"]]
    slowest = min(inside, key=lambda a: fitted[a]["bandwidth"])
    roles = {mesh_lib.axis_name(mesh, a): a for a in mesh_lib.AXES}
    # with nodes (processes), an axis's link is the one inside a node; the link between them is `inter_node`
    links = {roles.get(a, a): fitted[a if a in inside else slowest] for a in measured_axes}
    unmeasured = [role for role in mesh_lib.AXES if role not in links]
    for role in unmeasured:
        links[role] = dict(fitted[slowest])
    # every other kind's own fit, placed as the links are: on XLA:CPU a permute's latency is several times an
    # all-reduce's, and the hand-written allreduces are made of permutes
    own = {}
    for kind in kinds:
        if kind != link_kind:
            per_axis = {a: {"alpha": axes[a][kind]["alpha"], "bandwidth": axes[a][kind]["bandwidth"]}
                        for a in measured_axes}
            own[kind] = {roles.get(a, a): per_axis[a if a in inside else slowest] for a in measured_axes}
            own[kind].update({role: dict(per_axis[slowest]) for role in unmeasured})
    nodes = {}
    if across and jax.process_count() > 1:
        between = min(across, key=lambda a: fitted[a]["bandwidth"])
        nodes = {"devices_per_node": len(jax.local_devices()), "inter_node": dict(fitted[between]),
                 "nics_per_node": 1}
    worst = max(axes[a][k]["fit"]["worst_relative_error"] for a in axes for k in axes[a] if k in kinds)
    source = (f"measured by python -m jaxpar.calibrate on {platform.node() or 'this machine'} "
              f"({jax.devices()[0].platform}, {mesh.size} devices in {jax.process_count()} process(es), mesh "
              f"{mesh_lib.shape_line(mesh)}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; FLOP/s: median "
              f"sustained float32 matmul per device with every device busy; links: {link_kind} fit per axis, "
              f"each other kind's own fit under kinds "
              f"(worst residual of any fit {worst:.0%})")
    if unmeasured:
        source += f"; {', '.join(unmeasured)} not in the mesh: given {slowest}'s link"
    if nodes:
        source += (f"; a process is a node of {nodes['devices_per_node']} devices, the link between processes "
                   f"from {between}'s fit")
    # peak = sustained: a CPU has no datasheet peak to quote; what a device sustains is what was measured
    return {"name": "calibrated", "flops": float(compute["flops"]), "sustained": float(compute["flops"]),
            "memory": float(device_memory(mesh)), "launch": launch, "links": links, "kinds": own,
            "codecs": timed_codecs,
            **nodes, "source": source,
            MEASUREMENTS: {"mesh": dict(mesh.shape), "processes": jax.process_count(), "kinds": list(kinds),
                            "matmul": compute["per_size"], "axes": axes}}


def summary(profile: dict) -> list[str]:
    """The human-readable lines of a calibration: FLOP/s, then per axis and kind alpha, bandwidth and fit error."""
    c = profile[MEASUREMENTS]
    out = [f"sustained matmul: {profile['flops'] / 1e9:,.2f} GFLOP/s per device (median of "
           f"{', '.join(f'{n}: {f / 1e9:,.2f}' for n, f in c['matmul'].items()) or 'given'}); launching a step "
           f"{profile['launch'] * 1e6:,.1f} us"]
    m = c.get("model")  # the model's own step, when calibrated with --model (a key, not the mesh axis)
    if m:
        note = f"; {m['note']}" if m["note"] else ""
        fit_error = (f", fit rms {m['rms_relative_error']:.1%} worst {m['worst_relative_error']:.1%}"
                     if "rms_relative_error" in m else "")
        out.append(f"{m['name']}'s step (sync, mesh {m['mesh']}): " + ", ".join(
            f"batch {x['batch']} {x['measured'] * 1e3:,.3f} ms" for x in m["points"]) +
            f" -> utilisation {m['utilisation']:.3g} of the matmul rate, fixed cost {m['fixed'] * 1e6:,.1f} us per "
            f"step{fit_error}{note}")
    for name, timed in profile.get("codecs", {}).items():
        per = timed["seconds_per_element"] * 1e9
        out.append(f"codec {name} (N={timed['replicas']}): {per:.3f} ns per gradient element encoded + decoded "
                   f"({per / timed['flops_per_element']:.3f} ns per FLOP it counts)")
    for axis, kinds in c["axes"].items():
        where = "between processes" if kinds["crosses_processes"] else "within a process"
        out.append(f"{axis} (groups of {kinds['group']}, {where}):")
        for kind in c["kinds"]:
            k = kinds[kind]
            note = f"; {k['note']}" if k["note"] else ""
            out.append(f"  {kind:<19} alpha {k['alpha'] * 1e6:9.2f} us, bandwidth {k['bandwidth'] / 1e9:8.3f} GB/s "
                       f"(fit: rms {k['fit']['rms_relative_error']:.1%}, worst {k['fit']['worst_relative_error']:.1%}"
                       f"{note})")
    return out
