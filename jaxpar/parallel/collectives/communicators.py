"""The communicator protocol: an averaging algorithm over a manual mesh axis as an object (optax-like), and the
communicator called by a name."""

from __future__ import annotations

import inspect

from jaxpar.errors import OptionError
from jaxpar.parallel.collectives.algorithms import check_algorithm, torus_shape
from jaxpar.parallel.collectives.allreduce import allreduce_mean


class Communicator:
    """An averaging algorithm over a manual mesh axis, as an object (optax-like).

    - `init(params, num_replicas) -> state`: any state it keeps (this one keeps none: `()`); stored in
      `TrainState.comm_state` (a compressed one, `jaxpar.parallel.compression`, keeps per-replica parts);
    - `mean(tree, state, axis_name) -> (tree, state)`: the mean of every leaf over `axis_name`, inside a shard_map
      body where that axis is manual.
    """

    def __init__(self, algorithm: str = "psum", torus_x: int | None = None):
        check_algorithm(algorithm)
        if torus_x is not None and algorithm != "torus2d":
            raise OptionError("torus_x", torus_x, "applies only with {allreduce} torus2d", flag="--torus")
        self.name, self.torus_x = algorithm, torus_x

    @property
    def native(self) -> bool:
        """XLA's own collective: works on global (auto-sharded) arrays without flattening them."""
        return self.name == "psum"

    def init(self, params, num_replicas: int = 1):
        return ()

    def init_state(self, params, num_replicas: int):
        """`init`, for communicators written before it took the replica count (`init(params)`) too."""
        try:
            parameters = inspect.signature(self.init).parameters
        except (TypeError, ValueError):
            parameters = {}
        if len(parameters) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters.values()):
            return self.init(params, num_replicas)
        return self.init(params)

    def mean(self, tree, state, axis_name: str):
        return allreduce_mean(tree, axis_name, self.name, torus_x=self.torus_x), state

    def check(self, n: int) -> None:
        """Refuses a configuration that cannot run over an axis of `n` devices (before anything compiles)."""
        if self.name == "torus2d":
            torus_shape(n, self.torus_x)

    def __repr__(self):
        return f"Communicator({self.name!r}" + (f", torus_x={self.torus_x})" if self.torus_x else ")")


def check_allreduce(allreduce: str | None, torus_x: int | None) -> None:
    """Refuses an unknown algorithm name, or a torus X without torus2d (None = the compiler's all-reduce): the
    rules a `Communicator` is built with."""
    if allreduce is not None or torus_x is not None:
        Communicator(allreduce or "psum", torus_x)


def communicator(name: "str | Communicator" = "psum", torus_x: int | None = None) -> Communicator:
    """The communicator called `name` (psum, ring, torus2d, ps); a Communicator is returned unchanged."""
    return name if isinstance(name, Communicator) else Communicator(name, torus_x)
