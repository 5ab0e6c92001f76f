"""The collectives of a compiled step, read from its optimised HLO text: kind, result bytes per device, device
groups and the mesh axes they span, and how many times each runs per step.

Theory (`jaxpar.parallel.collectives.theoretical_traffic`) says what an algorithm should send; this module reads what
XLA emitted after its own passes (combining, async conversion, dtype promotion), so the two can be compared, priced
by the cost model (`jaxpar.cost.hardware`) and shown by `jaxpar.explain`. In an SPMD program device id i is partition
i, i.e. `mesh.devices.flat[i]`. `Collective.bytes` is the bytes of one run (what the shape says); `bytes_sent`, the
cost model (`jaxpar.cost.hardware.collective_seconds`) and `explain` multiply by `Collective.runs`: per-step numbers.
"""
from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from jaxpar.cost.hlo.program import (INSTRUCTION, OPCODE, OPERAND_NAME, array_shapes, hlo_text, parse_program,
                                     shape_bytes, split_shape, tuple_elements)

# attributes of a collective: its device groups, a permute's pairs, the JAX operation it came from
_GROUPS = re.compile(r"replica_groups=(\{\}|\{\{[\d,{} ]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                     r"|mesh\[[^\]]*\](?:, device_ids=\((?:\[[\d,]+\](?:T\([\d,]+\))?|[\d,]+)\))? \{[^}]*\})")
_PAIRS = re.compile(r"source_target_pairs=(\{\{.*?\}\})")
_IOTA = r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"
_OP_NAME = re.compile(r'op_name="([^"]*)"')
COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")


class Collective(NamedTuple):
    kind: str  # one of COLLECTIVE_KINDS
    bytes: int  # result bytes per device (an async pair: the -done result)
    group: int  # devices per group (a collective-permute: the longest chain of its pairs is not modelled: 2)
    axes: tuple | None  # mesh axes the groups span (None: no mesh given, or groups not readable)
    pairs: tuple = ()  # collective-permute: its (source, target) pairs
    arrays: tuple = ()  # (sorted dims, bytes) of each array of the result
    runs: int = 1  # times it runs per step: the product of the known trip counts of the while loops enclosing it
    loops: tuple = ()  # those while loops, outermost first: ((while instruction name, trip count or None), ...)
    op_name: str = ""  # the JAX operation it came from (HLO metadata), e.g. "jit(step)/shard_map/while/body/ppermute"
    groups: tuple = ()  # a group collective's device groups (device ids), read with a mesh: which node each is on


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    return ids.transpose([int(d) for d in perm.split(",")]) if perm else ids


def replica_groups(text: str, num_devices: int) -> list[list[int]]:
    """The device groups of `replica_groups=...`: explicit `{{0,1},{2,3}}`, iota `[2,4]<=[4,2]T(1,0)`, `{}` (one
    group of every device), or the mesh form `mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2))
    {'axis_0'}`: the devices (iota order unless `device_ids` says otherwise) laid out row-major on that mesh, one
    group per position on the axes not named in braces."""
    if text == "{}":
        return [list(range(num_devices))]
    if text.startswith("{"):
        return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", text[1:-1])]
    if text.startswith("mesh"):
        sizes = re.findall(r"'([^']+)'=(\d+)", text.partition("]")[0])
        names, shape = [n for n, _ in sizes], [int(v) for _, v in sizes]
        ids = re.search(r"device_ids=\((.*)\) \{", text)
        if ids and ids.group(1).startswith("["):
            grid = _iota(*re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", ids.group(1)).groups())
        elif ids:
            grid = np.asarray([int(d) for d in ids.group(1).split(",")])
        else:
            grid = np.arange(int(np.prod(shape)))
        grouped = re.findall(r"'([^']+)'", text.rpartition("{")[2])
        if any(name not in names for name in grouped):
            raise ValueError(f"replica_groups={text}: sub-axes are not supported by this parser")
        axes = [names.index(name) for name in grouped]
        rest = [i for i in range(len(shape)) if i not in axes]
        grid = grid.reshape(shape).transpose(rest + axes)
        return grid.reshape(-1, int(np.prod([shape[i] for i in axes]))).tolist()
    match = re.fullmatch(_IOTA, text)
    return _iota(match.group(2), match.group(3)).reshape([int(d) for d in match.group(1).split(",")]).tolist()


def spanned_axes(groups, mesh) -> tuple:
    """The mesh axes along which the devices of some group differ (device id i = `mesh.devices.flat[i]`)."""
    shape = tuple(mesh.devices.shape)
    coords = [np.unravel_index(np.asarray(g, dtype=np.int64), shape) for g in groups if len(g)]
    return tuple(a for i, a in enumerate(mesh.axis_names) if any(len(set(c[i].tolist())) > 1 for c in coords))


def _located(kind: str, tail: str, mesh) -> tuple[int, tuple | None, tuple, tuple]:
    """(group size, axes, pairs, groups) of one collective's attributes."""
    if kind == "collective-permute":
        found = _PAIRS.search(tail)
        pairs = tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", found.group(1))) if found else ()
        return 2, (spanned_axes([list(p) for p in pairs], mesh) if mesh is not None else None), pairs, ()
    found = _GROUPS.search(tail)
    if found is None and "replica_groups" in tail:
        return 1, None, (), ()
    size = mesh.size if mesh is not None else 1
    try:
        groups = replica_groups(found.group(1) if found else "{}", size)
    except (ValueError, AttributeError):
        return 1, None, (), ()
    group = max((len(g) for g in groups), default=1)
    if mesh is None:
        return group, None, (), ()
    return group, spanned_axes(groups, mesh), (), tuple(tuple(int(d) for d in g) for g in groups)


def collective_ops(compiled_or_hlo_text, mesh=None) -> list[Collective]:
    """Every collective in optimised SPMD HLO text or a `jax.stages.Compiled`, in program order (computation by
    computation).

    Async pairs count once, at `X-start`, with the bytes of `X-done`'s result: a `-start` result bundles the
    operand and scratch with the output. Each op is listed once, with the bytes of one run, and with `runs`: how
    many times it runs per step (the product of the known trip counts of the while loops around it; see the module
    docstring) and `loops`, those loops. With a `mesh`, each op's groups are placed on its axes.
    """
    program = parse_program(hlo_text(compiled_or_hlo_text))
    ops: list[dict] = []
    starts: dict[str, int] = {}  # start name -> its index in `ops`, until its done is seen
    for computation in (None,) + program.order:
        for line in program.lines[computation]:
            inst = INSTRUCTION.match(line)
            if not inst:
                continue
            shape, tail = split_shape(inst.group("rest"))
            op = OPCODE.match(tail)
            if not op:
                continue
            opcode = op.group("op")
            base = opcode.removesuffix("-start").removesuffix("-done")
            if base not in COLLECTIVE_KINDS:
                continue
            if opcode.endswith("-done"):
                start = OPERAND_NAME.search(op.group("operands"))  # the first operand is the matching -start
                if start and start.group(1) in starts:
                    ops[starts.pop(start.group(1))].update(bytes=shape_bytes(shape), arrays=array_shapes(shape))
                continue
            group, axes, pairs, groups = _located(base, tail, mesh)
            name = _OP_NAME.search(tail)
            entry = dict(kind=base, bytes=shape_bytes(shape), group=group, axes=axes, pairs=pairs, groups=groups,
                         arrays=array_shapes(shape), runs=program.runs[computation], loops=program.loops[computation],
                         op_name=name.group(1) if name else "")
            if opcode.endswith("-start"):
                elements = tuple_elements(shape) if shape.startswith("(") else [shape]
                # until its done is seen, a best guess from its own shape: all-gather-start is (operand, output),
                # collective-permute-start (operand, output, u32 contexts...)
                guess = elements[1] if len(elements) > 1 else elements[0]
                entry.update(bytes=shape_bytes(guess), arrays=array_shapes(guess))
                starts[inst.group("name")] = len(ops)
            ops.append(entry)
    return [Collective(**o) for o in ops]


def collective_stats(compiled_or_hlo_text, per_step: bool = False) -> dict[str, dict[str, int]]:
    """Count and result bytes (per device) of each collective kind in optimised HLO (see `collective_ops`).

    By default what the program contains: each op once, with the bytes of one run (an op inside a while loop counts
    once). `per_step`: how often they run in one step and the bytes of all those runs (each op times its `runs`)."""
    stats = {kind: dict(count=0, bytes=0) for kind in COLLECTIVE_KINDS}
    for op in collective_ops(compiled_or_hlo_text):
        times = op.runs if per_step else 1
        stats[op.kind]["count"] += times
        stats[op.kind]["bytes"] += times * op.bytes
    return stats


def unknown_loops(ops) -> list[str]:
    """Names of the while loops around `ops` whose trip count XLA did not give (each was counted as running once)."""
    return sorted({name for op in ops for name, trip in op.loops if trip is None})


def bytes_sent(op: Collective) -> float:
    """Bytes one device sends for `op` in one step with a bandwidth-optimal (ring) algorithm on its group of g, from
    its result bytes R: all-reduce 2(g-1)/g R, all-gather (g-1)/g R, reduce-scatter (g-1) R, all-to-all (g-1)/g R,
    and a collective-permute R; times `op.runs` (an op in a loop sends that much on every run)."""
    g, r = op.group, op.bytes
    if op.kind == "collective-permute":
        return float(r) * op.runs
    return op.runs * {"all-gather": (g - 1) / g * r, "reduce-scatter": (g - 1) * r,
                      "all-reduce": 2 * (g - 1) / g * r, "all-to-all": (g - 1) / g * r}[op.kind]
