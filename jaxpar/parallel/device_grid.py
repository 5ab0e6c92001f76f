"""The device grid: a mesh's devices laid out in its axes' order across processes (hosts), keeping the inner axes
inside a process, and which of its axes cross processes."""

from __future__ import annotations

import math

import numpy as np

from jaxpar.errors import MeshError


def device_grid(shape: tuple[int, ...], devices, spec: str = "", *, library: bool = False) -> np.ndarray:
    """The devices laid out as a (data, stage, fsdp, model) grid, keeping the inner axes inside a process (host).

    One process: the first prod(shape) devices in order. Several processes (each with the same number of devices,
    all of which the mesh must use): each axis is split into a part inside a process and a part across processes.
    The inside parts are filled from the innermost axis out: `model` first (tensor-parallel traffic, the heaviest,
    stays on a host's fast links), then `fsdp` (its per-layer all-gathers next), then `stage` (one activation per
    tick), then `data`. What does not fit inside one process crosses processes, `data` first, then `stage`: a 2x4
    mesh on 2 processes x 4 devices puts each data replica on one process; fsdp=8 on 2 x 4 splits fsdp into 4
    inside x 2 across; stage=2,model=4 on 2 x 4 puts each stage on one process. Within a process devices keep
    their id order; processes are ordered by process index.
    """
    count = math.prod(shape)
    processes = sorted({d.process_index for d in devices})
    if len(processes) == 1:
        return np.asarray(list(devices)[:count], dtype=object).reshape(shape)
    by_process = [sorted((d for d in devices if d.process_index == p), key=lambda d: d.id) for p in processes]
    local = len(by_process[0])
    subject = f"make_mesh({spec})" if library else f"--mesh {spec!r}"
    if any(len(group) != local for group in by_process) or count != len(devices):
        raise MeshError(f"{subject} uses {count} of {len(devices)} devices, but with {len(processes)} processes a "
                        f"mesh must use every device of every process (each has {local}); use a mesh of "
                        f"{len(devices)} devices, e.g. --mesh {len(devices) // local}x{local}")
    inside, left = [1] * len(shape), local
    for axis in reversed(range(len(shape))):  # innermost first
        inside[axis] = math.gcd(shape[axis], left)
        left //= inside[axis]
    across = [s // i for s, i in zip(shape, inside)]
    if left != 1 or math.prod(across) != len(processes):  # no clean split: keep the plain order
        return np.asarray([d for group in by_process for d in group], dtype=object).reshape(shape)
    # (across..., inside...) -> interleave each axis's across and inside parts -> the mesh shape
    grid = np.empty((len(processes), local), dtype=object)
    for row, group in enumerate(by_process):
        grid[row, :] = group
    grid = grid.reshape(*across, *inside)
    n = len(shape)
    order = [k for axis in range(n) for k in (axis, n + axis)]
    return grid.transpose(order).reshape(shape)


def crossing_positions(devices: np.ndarray) -> list[int]:
    """The positions of the grid's axes whose groups span more than one process (their collectives cross hosts)."""
    out = []
    for position in range(devices.ndim):
        rows = np.moveaxis(devices, position, -1).reshape(-1, devices.shape[position])
        if any(len({d.process_index for d in row}) > 1 for row in rows):
            out.append(position)
    return out
