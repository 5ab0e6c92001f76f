"""Gradient averaging over the replica axis, with the allreduce algorithm as a choice (a communicator object).

Every allreduce algorithm a run can choose lives here (the only place that calls `lax.ppermute` over the replica
axis), so every byte the trainer sends between replicas by algorithm goes through here and can be compared with
`theoretical_traffic` (see `jaxpar.cost.explain`):

- `algorithms`: the algorithms by name, the torus2d grid, their textbook traffic;
- `rings`: the hand-written algorithms built from `ppermute` (ring, torus2d, parameter server);
- `buffers`: tensor fusion, one flat buffer per dtype (and the one-buffer average across CPU processes);
- `allreduce`: the mean, sum and gather of a tree by algorithm (what the codecs of `jaxpar.parallel.compression`
  build on);
- `communicators`: the `Communicator` object and `communicator(name)`.

Algorithms (all return the same numbers as `lax.pmean`, up to float summation order):

- ``psum``: XLA's native all-reduce; the reference and the fastest on real hardware.
- ``ring``: reduce-scatter then all-gather around a ring of `lax.ppermute`s: 2(N-1) steps, each device sends
  2(N-1)/N of the buffer (bandwidth optimal, independent of N).
- ``torus2d``: Mikami et al. 2018: the axis as an X x Y grid (device i = y*X + x); ring reduce-scatter along X,
  ring allreduce along Y on the 1/X chunk, ring all-gather along X: the ring's bytes in 2(X-1)+2(Y-1) steps.
- ``ps``: parameter server: everyone sends to device 0, which averages and sends back: the central bottleneck.

The hand-written algorithms first fuse all leaves of one dtype into one flat buffer (Horovod tensor fusion), so
the step count does not grow with the number of parameters. Their result is *varying* over the axis as far as
`shard_map`'s type check knows (only a native collective can prove replication), so return it under an out_spec
that mentions the axis, or pass `check_vma=False` to `jax.shard_map`.

Example (8 CPU devices)::

    import jax, jax.numpy as jnp, jaxpar
    from jaxpar.parallel.collectives import allreduce_mean
    from jaxpar.parallel.mesh import REPLICA_AXIS
    from jaxpar.parallel.partitioning import PER_REPLICA  # one entry per device of the replica axis

    mesh = jaxpar.make_mesh("8")  # 8 replicas
    f = jax.jit(jax.shard_map(lambda g: allreduce_mean(g, REPLICA_AXIS, "ring"), mesh=mesh, in_specs=PER_REPLICA,
                              out_specs=PER_REPLICA))
    f(jnp.arange(8.0))  # every entry is 3.5

Strategies do not call these functions directly: they hold a `Communicator` (optax-like: `init` for any state it
keeps, which lives in `TrainState.comm_state`, and `mean` over a manual axis), chosen by name with
`communicator("ring")`. A stateful algorithm (compression with error feedback) is a new Communicator, not a change
to any strategy.
"""

from jaxpar.parallel.collectives.algorithms import (ALLREDUCE_ALGORITHMS, default_torus_x, theoretical_traffic,
                                                    torus_shape)
from jaxpar.parallel.collectives.allreduce import allgather, allreduce_mean, allreduce_sum
from jaxpar.parallel.collectives.buffers import allreduce_in_one_buffer
from jaxpar.parallel.collectives.communicators import Communicator, check_allreduce, communicator

__all__ = ["ALLREDUCE_ALGORITHMS", "Communicator", "allgather", "allreduce_in_one_buffer", "allreduce_mean",
           "allreduce_sum", "check_allreduce", "communicator", "default_torus_x", "theoretical_traffic", "torus_shape"]
