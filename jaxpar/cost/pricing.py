"""The price of one collective on a hardware profile: every hop on the axis's link, or as it runs over nodes.

A profile without nodes (`Profile.devices_per_node` None) prices a collective of R result bytes per device over a
group of g devices on the slowest link (alpha, beta) of the axes it spans:

    all-reduce       2(g-1) alpha + 2(g-1)/g R / beta      (ring / bandwidth-optimal)
    all-gather        (g-1) alpha +  (g-1)/g R / beta
    reduce-scatter    (g-1) alpha +   (g-1)  R / beta      (R = the scattered result)
    all-to-all        (g-1) alpha +  (g-1)/g R / beta
    collective-permute     alpha +           R / beta

With nodes, device d (a position in the mesh, `mesh.devices.flat[d]`) sits on node d // devices_per_node. A group
inside one node runs on the axis's link (alpha_i, beta_i) with the formulas above. A group over n > 1 nodes, k of
its devices per node, uses the link between nodes (alpha_e, beta_e per NIC) for the hops that leave a node, and the
m NICs of a node are shared by the c flows that leave it at once: beta_e' = beta_e x min(1, m / c).

    ring all-reduce (the native all-reduce, `allreduce="ring"`): 2(g-1) steps of R/g, each as slow as its slowest
        hop: 2(g-1) x max(alpha_i + R/(g beta_i), alpha_e + R/(g beta_e')); a ring enters and leaves each node
        once, so c = the groups with a device on the node
    hierarchical all-reduce (`allreduce="hierarchical"`): reduce-scatter inside the node, all-reduce of the 1/k
        shard between nodes, all-gather inside the node:
        2(k-1) (alpha_i + R/(k beta_i)) + 2(n-1) (alpha_e + R/(k n beta_e')), c = the devices of the node in the op
        (each runs its own ring between nodes)
    2D torus with X = k (the hand-written `torus2d` aligned with nodes) is the hierarchical all-reduce: its rows are
        nodes. It compiles to collective-permutes, each priced on its own (below), which sum to the same formula.
    reduce-scatter, all-gather, all-to-all over nodes: the flat ring formula with each step as slow as its slowest
        hop (as the ring all-reduce)
    collective-permute: alpha_i + R/beta_i if no pair leaves its node, else alpha_e + R/beta_e' with c = the most
        pairs leaving one node

The names of the formulas are functions here, so the published-result check (`benchmarks/published.py`) prices the
all-reduce of a step with the same code `--explain` and `sim_time` use.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

from jaxpar.parallel import mesh as mesh_lib

WIRE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes of one gradient element on the wire
SCALAR_BYTES = 64  # a collective this small is a metric mean or the non-finite flag, never a gradient


def _hop(chunk: float, link) -> float:
    return link.alpha + chunk / link.bandwidth


def shared(link, nics: int, flows: int):
    """The inter-node `link` as one of `flows` flows leaving a node with `nics` NICs sees it."""
    return replace(link, bandwidth=link.bandwidth * min(1.0, nics / max(flows, 1)))


def flat_seconds(kind: str, nbytes: float, g: int, link) -> float:
    """One run of a collective over a group of `g` on one link (the module docstring's first table)."""
    if kind == "collective-permute":
        return _hop(nbytes, link)
    if g <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (g - 1) * _hop(nbytes / g, link)
    if kind == "reduce-scatter":
        return (g - 1) * _hop(nbytes, link)
    return (g - 1) * _hop(nbytes / g, link)  # all-gather, all-to-all


def ring_allreduce_seconds(nbytes: float, g: int, nodes: int, intra, inter) -> float:
    """A ring all-reduce of `nbytes` over `g` devices on `nodes` nodes; `inter` already shared by its flows."""
    if nodes <= 1:
        return flat_seconds("all-reduce", nbytes, g, intra)
    per_node = g // nodes
    slowest = max(_hop(nbytes / g, inter), _hop(nbytes / g, intra) if per_node > 1 else 0.0)
    return 2 * (g - 1) * slowest


def hierarchical_allreduce_seconds(nbytes: float, per_node: int, nodes: int, intra, inter) -> float:
    """Reduce-scatter inside a node of `per_node`, all-reduce between `nodes` nodes, all-gather inside the node;
    `inter` already shared by the node's flows. The same as a 2D torus with X = per_node, Y = nodes."""
    k, n = per_node, nodes
    return 2 * (k - 1) * _hop(nbytes / k, intra) + 2 * (n - 1) * _hop(nbytes / (k * n), inter)


def _layout(groups, devices_per_node: int) -> tuple[int, int, int, int]:
    """(nodes a group spans, its devices per node, groups on the busiest node, the op's devices on it)."""
    spans = [Counter(d // devices_per_node for d in group) for group in groups]
    nodes = max(len(s) for s in spans)
    per_node = max(max(s.values()) for s in spans)
    touching = Counter(node for s in spans for node in s)
    devices = Counter()
    for s in spans:
        devices.update(s)
    return nodes, per_node, max(touching.values()), max(devices.values())


def once_seconds(op, profile, nbytes: float) -> float:
    """One run of `op` (a `jaxpar.cost.hlo.Collective`) moving `nbytes` per device on `profile`."""
    intra = profile.link(op.axes or (), op.kind)
    hierarchy = profile.devices_per_node
    if hierarchy is None or profile.inter_node is None:
        return flat_seconds(op.kind, nbytes, op.group, intra)
    if op.kind == "collective-permute":
        leaving = Counter(a // hierarchy for a, b in op.pairs if a // hierarchy != b // hierarchy)
        if not leaving:
            return _hop(nbytes, intra)
        return _hop(nbytes, shared(profile.inter_node, profile.nics_per_node, max(leaving.values())))
    if op.group <= 1 or not op.groups:
        return flat_seconds(op.kind, nbytes, op.group, intra)
    nodes, per_node, rings, devices = _layout(op.groups, hierarchy)
    if nodes <= 1:
        return flat_seconds(op.kind, nbytes, op.group, intra)
    g = op.group
    if op.kind == "all-reduce" and profile.allreduce == "hierarchical":
        inter = shared(profile.inter_node, profile.nics_per_node, devices)
        return hierarchical_allreduce_seconds(nbytes, per_node, nodes, intra, inter)
    inter = shared(profile.inter_node, profile.nics_per_node, rings)
    if op.kind == "all-reduce":
        return ring_allreduce_seconds(nbytes, g, nodes, intra, inter)
    chunk = nbytes if op.kind == "reduce-scatter" else nbytes / g
    return (g - 1) * max(_hop(chunk, inter), _hop(chunk, intra) if per_node > 1 else 0.0)


def gradient_exchange(op) -> bool:
    """Whether `op` is part of the exchange of gradients (or parameters) between replicas: a collective over the
    replica axis larger than a scalar; these are the bytes the profile's wire dtype scales."""
    return mesh_lib.REPLICA_AXIS in (op.axes or ()) and op.kind != "all-to-all" and op.bytes > SCALAR_BYTES


def collective_seconds(op, profile) -> float:
    """Seconds of `op` on `profile` in one step: one run's price times `op.runs` (an op in a pipeline's ticks or a
    gradient-accumulation loop runs every trip), its bytes scaled by the wire dtype if it exchanges gradients."""
    if op.kind != "collective-permute" and op.group <= 1:
        return 0.0
    nbytes = op.bytes
    if gradient_exchange(op):
        nbytes = nbytes * WIRE_BYTES[profile.wire] / 4  # the compiled step sends float32 gradients
    return once_seconds(op, profile, nbytes) * getattr(op, "runs", 1)
