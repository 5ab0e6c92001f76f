"""What a compiled step really does: its collectives and FLOPs, read from the optimised HLO text.

Theory (`jaxpar.parallel.collectives.theoretical_traffic`) says what an algorithm should send; this module reads what XLA
emitted after its own passes (combining, async conversion, dtype promotion), so the two can be compared, priced by
the cost model (`jaxpar.cost.hardware`) and shown by `jaxpar.explain`.

Why about 430 lines: reading the HLO text is one parser (computations, the call graph from ENTRY through loop
bodies, calls, fusions and branches, and each loop's trip count) that both the collectives and the FLOPs are read
from; split, the two would walk the same graph twice.

Each collective is one `Collective`: its kind, its result bytes per device (of one run), the size of its device
groups, the mesh axes those groups span, and how many times it runs per step. In an SPMD program device id i is
partition i, i.e. `mesh.devices.flat[i]`.

Loops. A `lax.scan` / `fori_loop` (a pipeline's ticks, gradient accumulation, a scan over layers) compiles to an
HLO `while` whose body holds its collectives once. The reading follows the call graph from ENTRY through while
bodies and conditions, calls, fusions and conditional branches: a collective runs, per step, the product of the
trip counts of the while loops that enclose it (XLA's optimised HLO gives `backend_config={"known_trip_count":
{"n":"K"}}` on a while it can count; one it cannot count is taken to run once, and `Collective.loops` says so with
a trip count of None). Each branch of a conditional counts as running every time the conditional does (an upper
bound). `Collective.bytes` stays the bytes of one run (what the shape says); `bytes_sent`, the cost model
(`jaxpar.cost.hardware.collective_seconds`) and `explain` multiply by `Collective.runs`: per-step numbers.

FLOPs. XLA's cost analysis (`compiled.cost_analysis()`) counts a while body's FLOPs once, whatever its trip count
(measured: a scan of 1, 2, 5 or 10 matmuls reports the same FLOPs). `loop_flops` adds the missing (K - 1) runs of
every counted loop body, costing each body with XLA's own cost analysis.
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
# A computation's first line, `[ENTRY] %name (params) -> shape {`, at the start of a line (instructions are indented)
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\{\s*$")
_CALLED = re.compile(r"\b(?P<key>calls|to_apply|body|condition|true_computation|false_computation|select|scatter)"
                     r"=%?(?P<name>[\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{(?P<names>[^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


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


class Program(NamedTuple):
    """The call graph of an HLO module: which computation runs how many times per step, inside which loops."""

    lines: dict  # computation name -> its instruction lines (None: lines outside any computation)
    headers: dict  # computation name -> its first line
    order: tuple  # computation names in text order
    entry: str | None
    preamble: tuple  # the module's lines before its first computation, minus the `HloModule` line
    calls: dict  # computation -> [(callee, the while instruction if callee is its body or condition, else None)]
    whiles: dict  # while instruction name -> (its computation, body, trip count or None)
    runs: dict  # computation -> times it runs per step (product of enclosing known trip counts; 1 if unreachable)
    loops: dict  # computation -> ((while name, trip or None), ...) enclosing it, outermost first (first call path)


def parse_program(text: str) -> Program:
    """The computations of HLO text and how often each runs per step (see the module docstring)."""
    lines: dict = {None: []}
    headers: dict = {}
    order, preamble, entry, current = [], [], None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line[:1].isspace():
            current = header.group("name")
            headers[current] = line
            lines[current], entry = [], current if header.group("entry") else entry
            order.append(current)
        elif current is not None and line.startswith("}"):
            current = None
        else:
            lines[current].append(line)
            if current is None and not order and not line.startswith("HloModule"):
                preamble.append(line)  # the debug tables (file names, stack frames) the instructions refer to
    calls: dict = {name: [] for name in order}
    whiles: dict = {}
    for name in order:
        for line in lines[name]:
            inst = _INSTRUCTION.match(line)
            attributes = line
            if inst:
                _, attributes = _split_shape(inst.group("rest"))
            is_while = inst is not None and re.match(r"\s*while\(", attributes) is not None
            if is_while:
                trip = _TRIP.search(attributes)
                body = re.search(r"\bbody=%?([\w.\-]+)", attributes)
                whiles[inst.group("name")] = (name, body.group(1) if body else None,
                                              int(trip.group(1)) if trip else None)
            for found in _CALLED.finditer(attributes):
                loop = inst.group("name") if is_while and found.group("key") in ("body", "condition") else None
                calls[name].append((found.group("name"), loop))
            for found in _CALLED_LIST.finditer(attributes):
                calls[name] += [(callee.strip().lstrip("%"), None) for callee in found.group("names").split(",")
                                if callee.strip()]
    runs, loops = {}, {}
    if entry is not None:  # callers before callees: a depth-first post-order from ENTRY, reversed
        seen, post = set(), []

        def visit(name):
            stack = [(name, iter(calls.get(name, ())))]
            seen.add(name)
            while stack:
                node, children = stack[-1]
                for child, _ in children:
                    if child in calls and child not in seen:
                        seen.add(child)
                        stack.append((child, iter(calls[child])))
                        break
                else:
                    post.append(node)
                    stack.pop()

        visit(entry)
        runs, loops = {entry: 1}, {entry: ()}
        for name in reversed(post):
            for callee, loop in calls[name]:
                if callee not in calls:
                    continue
                trip = whiles[loop][2] if loop else None
                runs[callee] = runs.get(callee, 0) + runs.get(name, 0) * (trip or 1)
                if callee not in loops:
                    loops[callee] = loops.get(name, ()) + (((loop, trip),) if loop else ())
    runs = {name: runs.get(name) or 1 for name in order} | {None: 1}
    loops = {name: loops.get(name, ()) for name in order} | {None: ()}
    return Program(lines, headers, tuple(order), entry, tuple(preamble), calls, whiles, runs, loops)


def _text(compiled_or_hlo_text) -> str:
    return compiled_or_hlo_text if isinstance(compiled_or_hlo_text, str) else compiled_or_hlo_text.as_text()


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
    program = parse_program(_text(compiled_or_hlo_text))
    ops: list[dict] = []
    starts: dict[str, int] = {}  # start name -> its index in `ops`, until its done is seen
    for computation in (None,) + program.order:
        for line in program.lines[computation]:
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
            group, axes, pairs, groups = _located(base, tail, mesh)
            name = _OP_NAME.search(tail)
            entry = dict(kind=base, bytes=shape_bytes(shape), group=group, axes=axes, pairs=pairs, groups=groups,
                         arrays=_arrays(shape), runs=program.runs[computation], loops=program.loops[computation],
                         op_name=name.group(1) if name else "")
            if opcode.endswith("-start"):
                elements = _tuple_elements(shape) if shape.startswith("(") else [shape]
                # until its done is seen, a best guess from its own shape: all-gather-start is (operand, output),
                # collective-permute-start (operand, output, u32 contexts...)
                guess = elements[1] if len(elements) > 1 else elements[0]
                entry.update(bytes=shape_bytes(guess), arrays=_arrays(guess))
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


class Flops(NamedTuple):
    """FLOPs of one step on one device."""

    per_device: float | None  # every while body counted its trip count times (None: the backend gives no count)
    xla: float | None  # XLA's cost analysis as it stands: each while body once
    note: str = ""  # how the loops were counted, when that changed anything or could not be done


def loop_flops(compiled_or_hlo_text, xla_flops: float | None) -> Flops:
    """`xla_flops` (XLA's cost analysis of the whole step, which counts a while body once) plus, for every while loop
    with a known trip count K, the K - 1 runs it left out: K - 1 times its body's FLOPs, costed by XLA's own cost
    analysis of the body alone (nested loops multiply). A conditional's cost is its costliest branch (XLA's rule),
    so a loop whose body picks a forward or a backward (1F1B's ticks) counts every run at the dearer one: the time of a
    tick in which some stages run a backward. A loop without a known trip count is counted once (see `note`); if
    the bodies cannot be costed (the HLO parser of this jaxlib missing), `xla_flops` is returned as it is."""
    if not xla_flops:
        return Flops(None, None)
    program = parse_program(_text(compiled_or_hlo_text))
    if not program.whiles or program.entry is None:
        return Flops(xla_flops, xla_flops)
    try:
        costed = _body_costs(program)
    except Exception as error:  # noqa: BLE001 - private XLA bindings: any failure leaves XLA's count
        return Flops(xla_flops, xla_flops, f"while bodies counted once (their cost could not be read: "
                                           f"{type(error).__name__})")
    unknown = sorted(name for name, (_, _, trip) in program.whiles.items() if trip is None)
    total = xla_flops + _extra(program, program.entry, costed, {})
    note = "every while body counted its trip count times (XLA's cost analysis counts it once)"
    if unknown:
        note += f"; {len(unknown)} loop(s) of unknown trip count counted once ({', '.join(unknown)})"
    return Flops(total, xla_flops, note if total != xla_flops or unknown else "")


def _outside_loops(program: Program, start: str) -> set:
    """`start` and what it calls without entering a while body or condition."""
    seen, stack = set(), [start]
    while stack:
        name = stack.pop()
        if name in seen or name not in program.calls:
            continue
        seen.add(name)
        stack += [callee for callee, loop in program.calls[name] if loop is None]
    return seen


def _extra(program: Program, computation: str, costed, memo) -> float:
    """FLOPs the static count leaves out of `computation`: for each while directly in it (not inside another
    while), (K - 1) x its body's static FLOPs + K x what that body's own static count leaves out."""
    if computation not in memo:
        around = _outside_loops(program, computation)
        memo[computation] = sum(
            ((trip or 1) - 1) * costed(body) + (trip or 1) * _extra(program, body, costed, memo)
            for where, body, trip in program.whiles.values() if where in around and body in program.calls)
    return memo[computation]


def _body_costs(program: Program):
    """`cost(body) -> FLOPs` of one run of a computation (nested loops once), by XLA's cost analysis of a module
    whose ENTRY is that computation."""
    import jax
    from jax._src.lib import xla_client
    from jaxlib import _hlo

    client = jax.devices()[0].client
    analyse = xla_client._xla.hlo_module_cost_analysis
    cache: dict = {}

    def closure(name):
        seen, stack = set(), [name]
        while stack:
            node = stack.pop()
            if node not in seen and node in program.calls:
                seen.add(node)
                stack += [callee for callee, _ in program.calls[node]]
        return seen

    def cost(name):
        if name not in cache:
            keep = closure(name)
            text = ["HloModule loop_body", *program.preamble]
            for computation in program.order:
                if computation in keep:
                    header = program.headers[computation].removeprefix("ENTRY").lstrip()
                    text += [("ENTRY " if computation == name else "") + header, *program.lines[computation], "}"]
            cache[name] = float(analyse(client, _hlo.hlo_module_from_text("\n".join(text))).get("flops", 0.0))
        return cache[name]

    return cost
