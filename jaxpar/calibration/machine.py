"""Measuring the machine at hand for the cost model (`python -m jaxpar.calibrate`): sustained matmul FLOP/s per
device, the time to launch a program, per mesh axis the links of each collective (`links.py`) and the gradient
codecs' own compute (`codecs.py`), gathered into a hardware profile.

Every program runs on all devices of the mesh at once, as a training step does: on XLA:CPU the emulated devices
share the machine's cores, so a device's FLOP/s is what it gets while the others work too. Matmul: each device
multiplies its own n x n float32 matrices (no communication) inside a loop of K trips; FLOP/s per device =
2 n^3 K / seconds (`timing.time_loop`).

`calibrate(...)` returns the profile as a plain dict (JSON-ready, `jaxpar.cost.profile`'s form); `summary` its
human-readable lines.
"""

from __future__ import annotations

import platform
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.calibration.codecs import CODECS, calibrate_codecs
from jaxpar.calibration.links import KINDS, SIZES, calibrate_axis, crosses_processes
from jaxpar.calibration.timing import launch_seconds, per_device, time_loop
from jaxpar.cost.profile import MEASUREMENTS
from jaxpar.errors import ConfigError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.runtime.resources import device_memory

MATMUL_SIZES = (128, 256, 512)  # the default transformer's matmuls are 128-512 wide per device
# the link kind the profile's single link per axis comes from: gradients are all-reduced
PROFILE_KIND = "all-reduce"


def matmul_flops(mesh, n: int, trips: int = 8, repeats: int = 3) -> float:
    """Sustained float32 FLOP/s of one device multiplying n x n matrices while every device does the same."""
    a, spec = per_device(mesh, (n, n), jnp.float32)

    def build(k):
        def local(x):
            return lax.fori_loop(0, k, lambda _, y: jnp.dot(y, x) * 0.5, x)

        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec))

    return 2 * n ** 3 / time_loop(build, (a,), trips, repeats)


def matmul(mesh, sizes=MATMUL_SIZES, trips: int = 8, repeats: int = 3, progress=None) -> dict:
    """Sustained FLOP/s per device at each matmul size, and their median (the profile's number)."""
    measured = {}
    for n in sizes:
        measured[str(n)] = matmul_flops(mesh, n, trips, repeats)
        if progress:
            progress(f"matmul {n} x {n} float32: {measured[str(n)] / 1e9:,.2f} GFLOP/s per device")
    return {"per_size": measured, "flops": statistics.median(measured.values())}


def calibrate(mesh, kinds=KINDS, sizes=SIZES, matmul_sizes=MATMUL_SIZES, trips: int = 8, repeats: int = 3,
              progress=None, measure=None, flops=None, codecs=None, measure_codec=None) -> dict:
    """Measures `mesh`: matmul FLOP/s, and every axis of size > 1 (see the module docstring). Returns the profile
    as a JSON-ready dict: `flops`, per axis of the mesh's roles a link (`alpha`, `bandwidth`, from the all-reduce
    fit), `memory`, `source`, and under `calibration` every measurement and fit. An axis of size 1 cannot be
    measured: it gets the measured link of the slowest measured axis, said in `source`. `measure` / `flops`
    replace the measurements (tests)."""
    measured_axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    if not measured_axes:
        devices = len(jax.devices())
        how = (f"use a mesh over 2 or more devices (e.g. --mesh {devices})" if devices > 1 else
               "JAX has 1 device here; measure on 2 or more (on CPU: start with more, e.g. "
               "XLA_FLAGS=--xla_force_host_platform_device_count=8, before JAX starts)")
        raise ConfigError(f"mesh {mesh_lib.shape_line(mesh)}: no axis has more than one device, so no link can be "
                          f"measured; {how}")
    compute = {"flops": flops, "per_size": {}} if flops is not None else matmul(mesh, matmul_sizes, trips, repeats,
                                                                               progress)
    launch = 0.0 if flops is not None else launch_seconds(mesh)
    if progress:
        progress(f"launching a program on {mesh.size} devices: {launch * 1e6:,.1f} us")
    timed_codecs = {} if flops is not None and measure_codec is None else calibrate_codecs(
        mesh, CODECS if codecs is None else codecs, trips=trips, repeats=repeats,
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
