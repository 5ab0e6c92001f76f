"""What a run on the Ray runtime is made of (`RunSpec`), checked on the driver before any process starts.

A RunSpec travels to every actor (Ray pickles it with cloudpickle): the user's model factory, loss, optimizer and
batches function go as functions; parameters and gradients never travel inside it (they go as numpy arrays).

The server rule comes from the strategy: `Sync()` is BSP through the server (staleness bound 0), `SSP(S)` bound S,
`ASP()` no bound; `LocalSGD` / `DiLoCo` push a change after H local steps (asynchronous local SGD).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from jaxpar.errors import ConfigError, MeshError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.strategies import ASP, SSP, DiLoCo, LocalSGD, Sync
from jaxpar.strategies.stragglers import Stragglers



@dataclass
class RunSpec:
    model: Callable  # rngs -> nnx.Module
    loss_fn: Callable
    optimizer: Any  # the server's optax transformation (local SGD / DiLoCo: the workers' inner one)
    mesh: tuple[int, ...]  # sizes of (data, stage, fsdp, model); data = the number of workers
    batches: Callable  # (worker, num_workers, seq) -> this worker's batch number `seq` (a dict of numpy arrays)
    steps: int  # server updates (versions)
    bound: float  # staleness bound: 0 = BSP, math.inf = ASP
    period: int = 1  # local steps per push (1: a gradient; H > 1: local SGD / DiLoCo's change)
    outer: Any = None  # the server's optimizer of local SGD / DiLoCo's changes (None: SGD with lr 1, the average)
    stragglers: Stragglers = field(default_factory=Stragglers)
    seed: int = 0
    grad_accum: int = 1
    skip_nonfinite: bool = True
    rules: Any = None
    strategy_name: str = ""
    server_shards: int = 1  # actors the server's parameters are split over, by bytes (`jaxpar.runtime.ray.shards`)

    @property
    def num_workers(self) -> int:
        return self.mesh[0]

    @property
    def worker_mesh(self) -> str:
        """Each worker's own mesh: the non-data axes, data = 1."""
        return ",".join(f"{axis}={size}" for axis, size in zip(mesh_lib.AXES, (1, *self.mesh[1:])))

    @property
    def devices_per_worker(self) -> int:
        return math.prod(self.mesh[1:])


def server_rule(strategy) -> tuple[float, int, Any]:
    """(staleness bound, local steps per push, outer optimizer) of a strategy on the runtime, or a ConfigError."""
    name = getattr(strategy, "name", type(strategy).__name__)
    if getattr(strategy, "local_after", 0):
        raise ConfigError(f"strategy {name}: post-local SGD (local_after) is not supported by the ray runtime; drop "
                          f"it, or use the emulated runtime")
    comm = getattr(strategy, "communicator", None)
    if getattr(comm, "codec", None) is not None:
        raise ConfigError(f"strategy {name}: gradient compression is not supported by the ray runtime; drop it, or "
                          f"use the emulated runtime")
    if isinstance(strategy, SSP):  # ASP too (a subclass)
        return (math.inf if strategy.bound is None else strategy.bound), 1, None
    if isinstance(strategy, DiLoCo):
        return 0.0, strategy.period, strategy.outer_tx
    if isinstance(strategy, LocalSGD):
        return 0.0, strategy.period, None
    if isinstance(strategy, Sync):
        return 0.0, 1, None
    raise ConfigError(f"strategy {name}: not supported by the ray runtime; use sync, ssp, asp, local_sgd or diloco")


def make_spec(model, loss_fn, optimizer, mesh, strategy, batches, steps: int, *, seed: int = 0, grad_accum: int = 1,
              skip_nonfinite: bool = True, rules=None, asynchronous_local: bool = True,
              server_shards: int = 1) -> RunSpec:
    """The checked RunSpec of `jaxpar.runtime.ray.run`'s arguments."""
    shape = mesh_lib.parse_mesh_spec(mesh) if isinstance(mesh, str) else tuple(mesh)
    if len(shape) != len(mesh_lib.AXES) or any(not isinstance(s, int) or s < 1 for s in shape):
        raise MeshError(f"mesh {mesh!r}: give a spec such as 'data=4' or 'data=2,model=2' (no -1: each worker "
                        f"makes its own devices)")
    if shape[0] < 2:
        raise MeshError(f"mesh {mesh!r}: the data axis is {shape[0]}, so there is one worker and nothing to run "
                        f"asynchronously; use data=2 or more (each index of the data axis is one worker process)")
    if isinstance(server_shards, bool) or not isinstance(server_shards, int) or server_shards < 1:
        raise ConfigError(f"server_shards {server_shards!r}: the number of actors the server's parameters are split "
                          f"over; use 1 (one server) or more")
    if not callable(batches):
        raise ConfigError(f"batches {batches!r}: pass a function (worker, num_workers, seq) -> batch dict")
    bound, period, outer = server_rule(strategy)
    if period > 1 and asynchronous_local:
        bound = math.inf  # asynchronous local SGD (Liu et al. 2024): a change is merged when it arrives
    return RunSpec(model, loss_fn, optimizer, shape, batches, steps, bound, period, outer,
                   getattr(strategy, "stragglers", None) or Stragglers(), seed, grad_accum, skip_nonfinite, rules,
                   strategy.name, server_shards)
