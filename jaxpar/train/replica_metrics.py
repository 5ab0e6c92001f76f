"""A step's per-replica metrics ([R] arrays, one value per replica) averaged on the device, without reading them.

Local SGD / DiLoCo's local and meeting steps leave their metrics per replica (averaging them inside the step would
be a collective over the replica axis, which those steps otherwise never have). `fit` reads them once ready and
averages on the host (`loop.host_metrics`, numpy's mean). `Trainer.step` used to do the same at once, a device-to-host
read that waited for the step every step; `ReplicaMeans` instead dispatches one small program (jitted once per
metrics structure) that averages them on the device, so the host runs ahead like under every other strategy.

The numbers are numpy's, bit for bit: the float32 values are added in the order numpy's mean adds them (in order
below 8 replicas, pairwise from 8: `_numpy_sum`), then divided by R; IEEE addition and division round alike on the
host and in XLA:CPU, which does not reorder float additions (`tests/strategies/test_strategies.py` checks bit-identity). Metrics that are not floating point (numpy's mean of integers is
float64, which the device does not compute) are read to the host and averaged there, as before.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd

PER_REPLICA_SUFFIX = "_per_replica"


def _numpy_sum(rows: list):
    """`rows` added in the order numpy's float add.reduce takes along a contiguous axis: in order below 8 elements,
    else eight running sums, paired, then the rest in order (up to 128; beyond, halves at a multiple of 8)."""
    n = len(rows)
    if n < 8:
        total = rows[0]
        for row in rows[1:]:
            total = total + row
        return total
    if n > 128:
        half = n // 2 - (n // 2) % 8
        return _numpy_sum(rows[:half]) + _numpy_sum(rows[half:])
    sums = list(rows[:8])
    whole = n - n % 8
    for start in range(8, whole, 8):
        sums = [sums[j] + rows[start + j] for j in range(8)]
    total = ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]))
    for row in rows[whole:]:
        total = total + row
    return total


def _mean_over_replicas(x):
    """numpy's `np.mean(x, axis=0)` in float32: pairwise over a 1-d [R] array, row after row over a [R, ...] one."""
    rows = [x[r] for r in range(x.shape[0])]
    if x.ndim == 1:
        total = _numpy_sum(rows)
    else:
        total = rows[0]
        for row in rows[1:]:
            total = total + row
    return total / x.shape[0]


def _on_device(value) -> bool:
    return isinstance(value, jax.Array) and value.ndim > 0 and jnp.issubdtype(value.dtype, jnp.floating)


class ReplicaMeans:
    """`means(metrics)`: each `[R]` float metric as its replica mean (a 0-d array on the device, for `loss`) and whole
    under `<name>_per_replica`; others as `loop.replica_means` gives them; host metrics unchanged."""

    def __init__(self, mesh):
        self._program = mesh_lib.in_mesh(jax.jit(lambda arrays: {k: _mean_over_replicas(v) for k, v in arrays.items()},
                                                 out_shardings=shd.replicated(mesh)), mesh)

    def __call__(self, metrics: Mapping) -> dict:
        averaged = self._program({k: v for k, v in metrics.items() if _on_device(v)})
        out = {}
        for key, value in metrics.items():
            if key in averaged:
                out[key], out[key + PER_REPLICA_SUFFIX] = averaged[key], value
            elif isinstance(value, jax.Array) and value.ndim:  # not floating point: numpy's mean on the host
                stacked = np.asarray(jax.device_get(value))
                out[key], out[key + PER_REPLICA_SUFFIX] = np.asarray(np.mean(stacked, axis=0)), stacked
            else:
                out[key] = value
        return out
