"""The exchange: the collectives a codec may use over the replica axis, bound to an axis and an algorithm."""

from __future__ import annotations

import jax
from jax import lax

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd
from jaxpar.parallel.collectives.allreduce import all_to_all, allgather, allreduce_sum, pull, push
from jaxpar.parallel.compression.powersgd import matrix_split


class Exchange:
    """The collectives a codec may use, bound to an axis and an algorithm. `shardings` (a whole-array codec's
    leaves' NamedShardings, in leaf order; None for codecs that run per shard or on a replica of one device) lets
    `mean` send each device's own part of what it averages. `groups` (per leaf, a key: leaves of one key differ
    between the same devices of a replica, so an elementwise codec may mix them in one chunk; None: unknown, each
    leaf on its own)."""

    def __init__(self, axis_name, algorithm, torus_x, shardings=None, groups=None):
        self.axis_name, self.algorithm, self.torus_x = axis_name, algorithm, torus_x
        self.shardings, self.groups = shardings, groups

    def sum(self, leaves):
        return allreduce_sum(leaves, self.axis_name, self.algorithm, torus_x=self.torus_x)

    def mean(self, leaves, specs=None):
        """The mean over replicas; with `specs` (each value's within-replica PartitionSpec, `layout`), inside a
        shard_map manual over the within-replica axes, so each device sends only its part: without it a hand-written
        algorithm fuses whole (gathered) arrays and the compiler lays the native one out as it likes."""
        if specs is None:
            return self._mean(leaves)
        # no `mesh=`: inside the replica-manual shard_map the context mesh is the one to use
        return jax.shard_map(self._mean, in_specs=(specs,), out_specs=specs,
                             axis_names=set(mesh_lib.WITHIN_REPLICA_AXES), check_vma=False)(leaves)

    def _mean(self, leaves):
        n = lax.axis_size(self.axis_name)
        return [(x / n).astype(x.dtype) for x in self.sum(leaves)]

    def layout(self, parts):
        """The within-replica specs of the values named by `parts`, (leaf index, 0: its P factor / 1: its Q
        factor / None: the leaf itself), or None when the leaves' layout is not known."""
        if self.shardings is None:
            return None
        out = []
        for i, factor in parts:
            sharding, shape = self.shardings[i]
            out.append(shd.within_replica_specs(sharding) if factor is None else
                       shd.factor_specs(sharding, len(shape), matrix_split(shape))[factor])
        return out

    def gather(self, tree):
        return allgather(tree, self.axis_name, self.algorithm, torus_x=self.torus_x)

    def scatter(self, tree):
        """All-to-all: each leaf [N, ...], row j to device j; returns row i from device i (`all_to_all`)."""
        return all_to_all(tree, self.axis_name, self.algorithm)

    def push(self, tree):
        """ps: every device's leaves stacked [N, ...] on device 0."""
        return push(tree, self.axis_name)

    def pull(self, tree):
        """ps: device 0's leaves on every device."""
        return pull(tree, self.axis_name)
