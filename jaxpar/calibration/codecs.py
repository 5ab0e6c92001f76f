"""Measuring a gradient codec's own compute on the machine at hand (`python -m jaxpar.calibrate`): seconds per
gradient element of its encode + decode, with every device busy, for `Profile.codecs`.

Why. The plan advisor priced a codec's compute as its FLOP count (`codec.flops`) at the matmul rate. On XLA:CPU's
emulated devices that rate says little about elementwise casts, int8 quantisation or a LAPACK QR: the advisor's
validation measured compressed sync plans at 2-4.5x their projection (docs/cost-model.md). So each codec is timed.

What is timed. On every device at once (shard_map over the whole mesh, as a training step runs), the codec's own
`mean(...)` on one device's gradient, `ELEMENTS` float32 elements (PowerSGD: a `MATRIX` matrix at its rank), with
error feedback as configured, inside a loop of K trips whose carry is the mean (so a trip waits for the previous
one). The exchange is replaced by a local one that sends nothing: a sum is x times N, a gather stacks N copies (each
offset, so the compiler cannot fold them), over `replicas` = N (default: the mesh's devices); fp16's scale pmax
stays a (scalar) collective over the mesh's first axis. The loop's one-trip time is
`jaxpar.calibration.timing.time_loop`'s (K = 1 and 1 + trips, the fastest of the repeats, the difference per trip).

Stored per codec: seconds per element, the codec's FLOPs per element in that measurement (`codec.flops`), and N.
`jaxpar.cost.codecs.compute_seconds` prices a codec at its FLOPs x (seconds / FLOPs) measured here, so int8's
decoding of N replicas' codes (3 N FLOPs per element) and PowerSGD's shapes scale by the FLOP count.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.calibration.timing import per_device, time_loop
from jaxpar.cost.codecs import flops
from jaxpar.parallel.compression import parse_codec

CODECS = ("bf16", "fp16", "int8", "powersgd:4")  # the plan advisor's codecs (and fp16)
ELEMENTS = 1 << 18  # per device for the elementwise codecs: 1 MiB of float32
MATRIX = (512, 512)  # PowerSGD's matrix per device (same element count)


class _LocalExchange:
    """`compression.Exchange`'s interface, sending nothing: what is timed is the codec's own work."""

    algorithm, groups = "psum", None  # int8's two-shot layout: every leaf its own group, n equal shards

    def __init__(self, n: int):
        self.n = n

    def sum(self, leaves):
        return [x * self.n for x in leaves]

    def mean(self, leaves, specs=None):
        return list(leaves)

    def layout(self, parts):
        return None  # whole arrays: nothing is split inside a replica here

    def gather(self, tree):
        return jax.tree.map(lambda x: jnp.stack([x + jnp.asarray(i, x.dtype) for i in range(self.n)]), tree)

    def scatter(self, tree):
        return tree  # [n, ...]: row i stands for what device i sends this device (int8's all-to-all)


def shape_of(codec) -> tuple:
    """The per-device gradient shape `codec` is timed on."""
    return (ELEMENTS,) if codec.elementwise else MATRIX


def codec_seconds_measured(mesh, name: str, replicas: int, trips: int = 8, repeats: int = 3) -> float:
    """Seconds of one encode + decode (`codec.mean` with a local exchange) of `shape_of(codec)` on every device."""
    codec = parse_codec(name)
    shape = shape_of(codec)
    zeros, spec = per_device(mesh, shape, np.float32)
    values = np.random.default_rng(0).standard_normal(zeros.shape).astype(np.float32)
    x = jax.device_put(values, zeros.sharding)
    axis = mesh.axis_names[0]
    exchange = _LocalExchange(replicas)

    def build(k):
        def local(g):
            own, shared = codec.init([g])
            own = jax.tree.leaves(own)  # what `mean` takes, as the trainer hands it (int8's two residuals in order)

            def trip(_, carry):
                leaf, own, shared = carry
                means, own, shared = codec.mean([leaf], own, shared, exchange, replicas, axis)
                return means[0], own, shared

            return jax.lax.fori_loop(0, k, trip, (g, own, shared))[0]

        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))

    return time_loop(build, (x,), trips, repeats)


def calibrate_codecs(mesh, codecs=CODECS, replicas: int | None = None, trips: int = 8, repeats: int = 3,
                     measure: Callable | None = None, progress=None) -> dict:
    """{codec name: {"seconds_per_element", "flops_per_element", "replicas"}} (`Profile.codecs`). `measure(name,
    replicas) -> seconds of one encode + decode of shape_of(codec)` replaces the measurement (tests)."""
    n = replicas or mesh.size
    measure = measure or (lambda name, r: codec_seconds_measured(mesh, name, r, trips, repeats))
    out = {}
    for name in codecs:
        codec = parse_codec(name)
        shape = shape_of(codec)
        elements = math.prod(shape)
        seconds = measure(name, n)
        out[name] = {"seconds_per_element": seconds / elements,
                     "flops_per_element": flops(codec, [shape], n) / elements, "replicas": n}
        if progress:
            progress(f"codec {name} encode + decode of {'x'.join(map(str, shape))} float32 per device (N={n}): "
                     f"{seconds * 1e6:,.1f} us, {seconds / elements * 1e9:.3f} ns per element")
    return out
