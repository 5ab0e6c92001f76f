"""What a run needs from its devices, checked before it is asked for, and device failures said in one line.

- `device_memory(mesh)`: the bytes one device may use;
- `check_step_memory`: a compiled step's per-device bytes (XLA's `memory_analysis`: arguments + outputs - donated
  aliases + temporaries) against that, before the step first runs; skipped when a cheap bound from XLA's cost
  analysis already fits (`fits_by_bound`);
- `DeviceError`: a step that failed on the device (out of memory, a failing callback, ...), raised as one line
  instead of the raw runtime error or a wait that never ends.
"""

from __future__ import annotations

import os
import time

import jax

from jaxpar.errors import JaxparError, ResourceError


class DeviceError(JaxparError):
    """A step failed while running on the device; the train state it was given is gone (donated, never updated).

    On XLA:CPU the other devices of a failed collective can stay blocked, so a process may not exit normally
    afterwards: the command line ends with `os._exit` once the message and the metrics are written.
    """

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


def device_memory(mesh) -> int:
    """Bytes one device may use: its reported limit, or on CPU the machine's memory shared by its devices."""
    device = mesh.local_devices[0] if mesh.local_devices else mesh.devices.flat[0]  # this process's
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // max(len(jax.local_devices(backend=device.platform)), 1)


def check_fits(needed: int, mesh, what: str, advice: str) -> None:
    """Refuses `what` when its `needed` bytes per device exceed a device's memory, naming both numbers and
    `advice`."""
    available = device_memory(mesh)
    if needed > available:
        raise ResourceError(f"{what} needs {needed:,} bytes per device but a device has {available:,}; {advice}")


def step_bytes(compiled) -> dict[str, int] | None:
    """Per-device bytes of a compiled step by XLA's memory analysis (None where the backend gives none)."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, AttributeError, jax.errors.JaxRuntimeError):
        return None
    if stats is None:
        return None
    parts = {"arguments": stats.argument_size_in_bytes, "outputs": stats.output_size_in_bytes,
             "donated": stats.alias_size_in_bytes, "temporaries": stats.temp_size_in_bytes}
    parts["total"] = parts["arguments"] + parts["outputs"] - parts["donated"] + parts["temporaries"]
    return parts


def fits_by_bound(fixed: int, accessed: float | None, available: int) -> bool:
    """Whether a step surely fits a device without XLA's memory analysis (which serialises the whole program: at
    XLA:CPU's -O0 it costs about half the compilation). Every temporary is some operation's output, every output
    is written by an operation and the batch is read by one, so arguments + outputs + temporaries stay below
    2 x (`fixed`, the train state, + `accessed`, the bytes the step's operations read and write by XLA's cost
    analysis). Measured on the built-in models' steps, the exact total is 4 to 10% of that bound."""
    return accessed is not None and 2 * (fixed + accessed) <= available


def check_step_memory(compiled, mesh, name: str, rows: int, divisor: int, fixed: int,
                      accessed: float | None = None) -> None:
    """Refuses a step variant whose per-device bytes exceed a device's memory, naming both numbers and a batch
    that would fit, estimated as if everything but `fixed` (the train state) grew with the batch. `accessed`: the
    step's bytes accessed by XLA's cost analysis, for `fits_by_bound`."""
    available = device_memory(mesh)
    if fits_by_bound(fixed, accessed, available):
        return
    parts = step_bytes(compiled)
    if parts is None or parts["total"] <= available:
        return
    growing = max(parts["total"] - fixed, 1)  # what scales with the batch (activations, the batch itself)
    fits = int(rows * (available - fixed) / growing) // divisor * divisor
    if fits >= divisor:
        hint = (f"use a global batch of at most about {fits} rows (now {rows}), or split it into microbatches "
                f"(grad_accum)")
    else:
        smallest = fixed + growing * divisor // rows
        hint = (f"even the smallest global batch ({divisor} rows) would need about {smallest:,}: make the step's "
                f"activations smaller (a smaller model or shorter inputs) or shard it over more devices")
    raise ResourceError(f"step {name!r} needs {parts['total']:,} bytes per device (arguments {parts['arguments']:,}, "
                        f"outputs {parts['outputs']:,}, temporaries {parts['temporaries']:,}, donated "
                        f"{parts['donated']:,} reused) but a device has {available:,}; {hint}")


def device_error(error: Exception, step: int) -> DeviceError:
    """The one line for a step that failed on the device."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    first = lines[0]
    if "Traceback" in first:  # a failing host callback: its status, then the Python exception (the last line)
        first = f"{first.split(':')[0]}: {lines[-1]}"
    lost = ""
    if jax.process_count() > 1:  # a collective failed: usually because another process died
        from jaxpar.runtime.distributed import lost_processes

        gone = lost_processes()
        if gone:
            lost = (f"process{'es' if len(gone) > 1 else ''} {', '.join(map(str, gone))} of {jax.process_count()} "
                    f"{'are' if len(gone) > 1 else 'is'} lost (stopped responding); ")
    return DeviceError(f"{lost}step {step + 1} failed on the device: {first[:300]}; its train state is lost "
                       f"(restart from a checkpoint{' with --resume' if lost else ''} or a fresh state)", step)


SHORTEST_POLL = 5e-5  # seconds: about the shortest sleep Linux gives (its default timer slack is 50 us)
POLL_FRACTION = 0.05  # a poll sleeps at most this fraction of the wait so far


def next_poll(delay: float, waited: float) -> float:
    """The sleep before `wait_ready`'s next poll, after one of `delay` seconds and `waited` seconds in all: doubling,
    but never more than `POLL_FRACTION` of the wait so far, so a wait returns within 5% (plus one shortest sleep)
    of the moment its step is ready: 1 ms steps are not held up by a poll (the earlier doubling to a fixed 2 ms cap
    could sleep past a whole step), and a long step is still polled rarely."""
    return max(SHORTEST_POLL, min(2 * delay, POLL_FRACTION * waited))


def wait_ready(tree, step: int) -> None:
    """Returns once every array in `tree` is computed; raises `DeviceError` as soon as one device's part failed.

    Waiting on a whole array (or on device 0's part) would never return when another device failed mid-step: the
    devices still healthy stay blocked in the step's next collective. So each device's part is polled (`next_poll`),
    and the first one that is ready with an error is reported.
    """
    arrays = [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]
    if not arrays or arrays[0].is_ready():
        parts = arrays  # the usual case: read at once (an error, if any, raises below)
    else:  # one output's parts: a step's outputs on a device are ready together
        parts = [shard.data for shard in arrays[0].addressable_shards]
    started = time.perf_counter()
    delay = SHORTEST_POLL
    while True:
        pending = []
        for part in parts:
            if not part.is_ready():
                pending.append(part)
                continue
            try:
                part.block_until_ready()
            except jax.errors.JaxRuntimeError as error:
                raise device_error(error, step) from None
        if not pending:
            return
        parts = pending
        time.sleep(delay)
        delay = next_poll(delay, time.perf_counter() - started)


def cost_analysis(compiled) -> dict:
    """XLA's cost analysis of a compiled program on one device ({} where the backend gives none)."""
    try:
        analysis = compiled.cost_analysis()
    except (NotImplementedError, AttributeError, jax.errors.JaxRuntimeError):
        return {}
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    return dict(analysis or {})


def step_flops(compiled, analysis: dict | None = None) -> float | None:
    """FLOPs of one run of a compiled step on one device, by XLA's cost analysis (`analysis`, if already read;
    None where the backend gives none). These are the compiled program's FLOPs (backward pass, optimizer and
    collectives' arithmetic included), not an analytic 6 x parameters x tokens."""
    flops = (cost_analysis(compiled) if analysis is None else analysis).get("flops")
    return float(flops) if flops and flops > 0 else None


def bytes_accessed(analysis: dict) -> float | None:
    """The bytes a program's operations read and write, from a `cost_analysis` (None where it has none)."""
    accessed = analysis.get("bytes accessed")
    return float(accessed) if accessed is not None and accessed >= 0 else None


_PEAK: dict = {}


def measured_matmul_peak(size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of this host's CPU on a float32 matmul (size x size, the best of `repeats`, on one JAX CPU device,
    which uses every core): a measured peak to set a CPU run's FLOPs against. Measured once per process."""
    if "cpu" not in _PEAK:
        import time

        import jax.numpy as jnp

        device = jax.local_devices(backend="cpu")[0]
        a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
        matmul = jax.jit(lambda x: x @ x)
        matmul(a).block_until_ready()
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            matmul(a).block_until_ready()
            best = min(best, time.perf_counter() - started)
        _PEAK["cpu"] = 2 * size ** 3 / best
    return _PEAK["cpu"]
