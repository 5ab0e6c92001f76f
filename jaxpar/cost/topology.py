"""Where the replicas sit on a hardware profile's nodes, and the torus2d grid that follows them.

A profile with nodes puts mesh position d (`mesh.devices.flat[d]`) on node d // devices_per_node. The replica axis
is the outermost mesh axis, so replica r holds positions r x W .. (r+1) x W - 1 (W = the devices inside one replica)
and a node holds devices_per_node / W consecutive replicas. A `torus2d` all-reduce whose X equals that number has
its rows inside a node (the X-rings on the fast link) and its columns between nodes (the Y-rings on the NICs): the
hierarchical all-reduce (`jaxpar.cost.pricing`). `Sync('torus2d')` without an explicit `torus_x` takes it when the
trainer's profile has nodes (`aligned`); an explicit `torus_x` always wins.
"""
from __future__ import annotations

import copy

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.collectives import communicator
from jaxpar.parallel.compression import compressed

TORUS = "torus2d"


def replicas_per_node(mesh, profile) -> int | None:
    """Replicas on one node of `profile`, if a node holds a whole number (> 1) of them and the replica count is a
    multiple of it (else None: no grid follows the nodes)."""
    if profile is None or not profile.devices_per_node:
        return None
    replicas = mesh_lib.replica_count(mesh)
    within = mesh.size // replicas
    if profile.devices_per_node % within:
        return None
    x = profile.devices_per_node // within
    return x if 1 < x < replicas and replicas % x == 0 else None


def aligned(strategy, mesh, profile):
    """`strategy` itself, or a copy whose torus2d communicator has X = the replicas per node of `profile` (when its
    own torus_x is unset and the nodes allow it)."""
    comm = getattr(strategy, "communicator", None)
    x = replicas_per_node(mesh, profile)
    if comm is None or comm.name != TORUS or comm.torus_x is not None or x is None:
        return strategy
    strategy = copy.copy(strategy)
    codec = getattr(comm, "codec", None)  # a compressed torus2d keeps its codec on the aligned grid
    strategy.communicator = communicator(TORUS, x) if codec is None else compressed(communicator(TORUS, x), codec)
    strategy.node_aligned = True
    return strategy


def torus_note(strategy, mesh, profile) -> str:
    """How the torus2d grid of `strategy` was chosen, for `--explain` ('' if it is not torus2d)."""
    comm = getattr(strategy, "communicator", None)
    if comm is None or comm.name != TORUS:
        return ""
    if getattr(strategy, "node_aligned", False):
        return (f"X = {comm.torus_x}, the replicas on one node of {profile.name} ({profile.devices_per_node} devices "
                f"per node): X-rings inside a node, Y-rings between nodes (the hierarchical all-reduce)")
    if comm.torus_x is not None:
        return f"X = {comm.torus_x}, as given (torus_x)"
    return "X = the divisor nearest the square root (no node layout in the profile to follow)"
