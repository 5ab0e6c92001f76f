"""What a compiled step really does: its collectives, read from the optimised HLO text.

Theory (`jaxpar.parallel.collectives.theoretical_traffic`) says what an algorithm should send; this module reads what XLA
emitted after its own passes (combining, async conversion, dtype promotion), so the two can be compared, priced by
the cost model (`jaxpar.cost.hardware`) and shown by `jaxpar.explain`.

Each collective is one `Collective`: its kind, its result bytes per device, the size of its device groups and the
mesh axes those groups span. In an SPMD program device id i is partition i, i.e. `mesh.devices.flat[i]`.
"""
from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")

# One HLO instruction: `[ROOT] %name = <shape> <opcode>(<operands>), attrs`. The shape is an array shape
# `f32[8,16]{1,0}` or a (possibly nested) tuple `(f32[16]{0}, u32[])`; it is cut out by bracket matching.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"\s*(?P<op>[\w\-]+)\((?P<operands>.*)")
_OPERAND_NAME = re.compile(r"%([\w.\-]+)")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")
_GROUPS = re.compile(r"replica_groups=(\{\}|\{\{[\d,{} ]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                     r"|mesh\[[^\]]*\](?:, device_ids=\((?:\[[\d,]+\](?:T\([\d,]+\))?|[\d,]+)\))? \{[^}]*\})")
_PAIRS = re.compile(r"source_target_pairs=(\{\{.*?\}\})")
_IOTA = r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"


class Collective(NamedTuple):
    kind: str  # one of COLLECTIVE_KINDS
    bytes: int  # result bytes per device (an async pair: the -done result)
    group: int  # devices per group (a collective-permute: the longest chain of its pairs is not modelled: 2)
    axes: tuple | None  # mesh axes the groups span (None: no mesh given, or groups not readable)
    pairs: tuple = ()  # collective-permute: its (source, target) pairs
    arrays: tuple = ()  # (sorted dims, bytes) of each array of the result


def _element_bits(dtype: str) -> int:
    """Bits of one HLO element type: f32 -> 32, bf16 -> 16, f8e4m3fn -> 8, s4 -> 4, pred -> 8, token -> 0."""
    if dtype == "pred":
        return 8
    match = re.match(r"[a-z]+?(\d+)", dtype)
    return int(match.group(1)) if match else 0


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string, summed over tuple elements (`f32[<=8]` dynamic dims count at their bound)."""
    total = 0
    for m in _ARRAY.finditer(shape):
        elements = 1
        for dim in filter(None, m.group("dims").split(",")):
            elements *= int(dim.strip().lstrip("<="))
        total += (elements * _element_bits(m.group("dtype")) + 7) // 8
    return total


def _arrays(shape: str) -> tuple:
    """(sorted dims, bytes) of each array in an HLO shape (a tuple result holds several)."""
    return tuple((tuple(sorted(int(d.strip().lstrip("<=")) for d in m.group("dims").split(",") if d.strip())),
                  shape_bytes(m.group(0))) for m in _ARRAY.finditer(shape))


def _split_shape(rest: str) -> tuple[str, str]:
    """(shape, remainder) of the text after `=`."""
    if not rest.startswith("("):
        shape, _, tail = rest.partition(" ")
        return shape, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[: i + 1], rest[i + 1:]
    return rest, ""


def _tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape."""
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            parts.append(shape[start:i].strip())
            start = i + 1
    return parts


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


def _located(kind: str, tail: str, mesh) -> tuple[int, tuple | None, tuple]:
    """(group size, axes, pairs) of one collective's attributes."""
    if kind == "collective-permute":
        found = _PAIRS.search(tail)
        pairs = tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", found.group(1))) if found else ()
        return 2, (spanned_axes([list(p) for p in pairs], mesh) if mesh is not None else None), pairs
    found = _GROUPS.search(tail)
    if found is None and "replica_groups" in tail:
        return 1, None, ()
    size = mesh.size if mesh is not None else 1
    try:
        groups = replica_groups(found.group(1) if found else "{}", size)
    except (ValueError, AttributeError):
        return 1, None, ()
    group = max((len(g) for g in groups), default=1)
    if mesh is None:
        return group, None, ()
    return group, spanned_axes(groups, mesh), ()


def collective_ops(compiled_or_hlo_text, mesh=None) -> list[Collective]:
    """Every collective in optimised SPMD HLO text or a `jax.stages.Compiled`, in program order.

    Async pairs count once, at `X-start`, with the bytes of `X-done`'s result: a `-start` result bundles the
    operand and scratch with the output. Counts are static: an op inside a while loop body counts once. With a
    `mesh`, each op's groups are placed on its axes.
    """
    text = compiled_or_hlo_text if isinstance(compiled_or_hlo_text, str) else compiled_or_hlo_text.as_text()
    ops: list[dict] = []
    starts: dict[str, int] = {}  # start name -> its index in `ops`, until its done is seen
    for line in text.splitlines():
        inst = _INSTRUCTION.match(line)
        if not inst:
            continue
        shape, tail = _split_shape(inst.group("rest"))
        op = _OPCODE.match(tail)
        if not op:
            continue
        opcode = op.group("op")
        base = opcode.removesuffix("-start").removesuffix("-done")
        if base not in COLLECTIVE_KINDS:
            continue
        if opcode.endswith("-done"):
            start = _OPERAND_NAME.search(op.group("operands"))  # the first operand is the matching -start
            if start and start.group(1) in starts:
                ops[starts.pop(start.group(1))].update(bytes=shape_bytes(shape), arrays=_arrays(shape))
            continue
        group, axes, pairs = _located(base, tail, mesh)
        entry = dict(kind=base, bytes=shape_bytes(shape), group=group, axes=axes, pairs=pairs, arrays=_arrays(shape))
        if opcode.endswith("-start"):
            elements = _tuple_elements(shape) if shape.startswith("(") else [shape]
            # until its done is seen, a best guess from its own shape: all-gather-start is (operand, output),
            # collective-permute-start (operand, output, u32 contexts...)
            guess = elements[1] if len(elements) > 1 else elements[0]
            entry.update(bytes=shape_bytes(guess), arrays=_arrays(guess))
            starts[inst.group("name")] = len(ops)
        ops.append(entry)
    return [Collective(**o) for o in ops]


def collective_stats(compiled_or_hlo_text) -> dict[str, dict[str, int]]:
    """Count and result bytes (per device) of each collective kind in optimised HLO (see `collective_ops`)."""
    stats = {kind: dict(count=0, bytes=0) for kind in COLLECTIVE_KINDS}
    for op in collective_ops(compiled_or_hlo_text):
        stats[op.kind]["count"] += 1
        stats[op.kind]["bytes"] += op.bytes
    return stats


def bytes_sent(op: Collective) -> float:
    """Bytes one device sends for `op` with a bandwidth-optimal (ring) algorithm on its group of g, from its result
    bytes R: all-reduce 2(g-1)/g R, all-gather (g-1)/g R, reduce-scatter (g-1) R, all-to-all (g-1)/g R, and a
    collective-permute R."""
    g, r = op.group, op.bytes
    if op.kind == "collective-permute":
        return float(r)
    return {"all-gather": (g - 1) / g * r, "reduce-scatter": (g - 1) * r, "all-reduce": 2 * (g - 1) / g * r,
            "all-to-all": (g - 1) / g * r}[op.kind]
