"""HLO text read as a program: its computations, the call graph from ENTRY through loop bodies, calls, fusions and
branches, how many times each computation runs per step (the trip counts of the while loops around it), and the
bytes of HLO shapes.

A `lax.scan` / `fori_loop` (a pipeline's ticks, gradient accumulation, a scan over layers) compiles to an HLO `while`
whose body holds its work once. The reading follows the call graph from ENTRY through while bodies and conditions,
calls, fusions and conditional branches: a computation runs, per step, the product of the trip counts of the while
loops that enclose it (XLA's optimised HLO gives `backend_config={"known_trip_count":{"n":"K"}}` on a while it can
count; one it cannot count is taken to run once, with a trip count of None). Each branch of a conditional counts as
running every time the conditional does (an upper bound).
"""
from __future__ import annotations

import re
from typing import NamedTuple

# One HLO instruction: `[ROOT] %name = <shape> <opcode>(<operands>), attrs`. The shape is an array shape
# `f32[8,16]{1,0}` or a (possibly nested) tuple `(f32[16]{0}, u32[])`; it is cut out by bracket matching.
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
OPCODE = re.compile(r"\s*(?P<op>[\w\-]+)\((?P<operands>.*)")
OPERAND_NAME = re.compile(r"%([\w.\-]+)")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")
# A computation's first line, `[ENTRY] %name (params) -> shape {`, at the start of a line (instructions are indented)
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\{\s*$")
_CALLED = re.compile(r"\b(?P<key>calls|to_apply|body|condition|true_computation|false_computation|select|scatter)"
                     r"=%?(?P<name>[\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{(?P<names>[^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


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
            inst = INSTRUCTION.match(line)
            attributes = line
            if inst:
                _, attributes = split_shape(inst.group("rest"))
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


def hlo_text(compiled_or_hlo_text) -> str:
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


def array_shapes(shape: str) -> tuple:
    """(sorted dims, bytes) of each array in an HLO shape (a tuple result holds several)."""
    return tuple((tuple(sorted(int(d.strip().lstrip("<=")) for d in m.group("dims").split(",") if d.strip())),
                  shape_bytes(m.group(0))) for m in _ARRAY.finditer(shape))


def split_shape(rest: str) -> tuple[str, str]:
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


def tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape."""
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            parts.append(shape[start:i].strip())
            start = i + 1
    return parts
