"""How a program is timed on every device at once: a loop of K trips timed at K = 1 and 1 + N, the fastest of a few
calls each, the difference per trip (program launch, dispatch and the loop's own entry cancel out); and the
per-device buffers the timed programs run on."""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.parallel import partitioning as shd

# trips adding less than this share of the 1-trip call are noise: N real ops take more than N / 800 of a launch
NOISE = 0.01


def time_loop(build: Callable[[int], Callable], args, trips: int, repeats: int) -> float:
    """Seconds of one trip of the loop program `build(K)` (a jitted function of `args` looping K times):
    (fastest call at 1 + trips) - (fastest call at 1), over trips. The fastest of the repeats, not the median: what
    other work on the machine adds is noise, never the link's own cost. A difference below NOISE of the 1-trip call
    (noise larger than the trips' work) gives the longer call over its trips instead, an upper bound."""

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


def per_device(mesh, shape, dtype):
    """A zero array with one `shape` block per device (every mesh axis splits the leading dimension), and its spec."""
    sharding = shd.leading_over_devices(mesh)
    full = (mesh.size * shape[0],) + tuple(shape[1:])
    return jax.device_put(jnp.zeros(full, dtype), sharding), sharding.spec


def launch_seconds(mesh, repeats: int = 30) -> float:
    """Seconds to start a program on every device of the mesh and see it end: the fastest of `repeats` calls of a
    one-element add per device (each call waited for), what every step pays whatever its size."""
    x, spec = per_device(mesh, (1,), jnp.float32)
    fn = jax.jit(jax.shard_map(lambda y: y + 1, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.block_until_ready(fn(x))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        x = jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - started)
    return min(times)
