"""What a compiled step really does: collective counts and bytes read from the optimised HLO.

Theory (`jaxpar.collectives.theoretical_traffic`) says what an algorithm should send; this module reads what XLA
actually emitted after its own passes (combining, async conversion, dtype promotion), so the two can be compared.
"""
from __future__ import annotations

import re

COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")

# One HLO instruction: `[ROOT] %name = <shape> <opcode>(<operands>), attrs`. The shape is an array shape
# `f32[8,16]{1,0}` or a (possibly nested) tuple `(f32[16]{0}, u32[])`; it is cut out by bracket matching.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"\s*(?P<op>[\w\-]+)\((?P<operands>.*)")
_OPERAND_NAME = re.compile(r"%([\w.\-]+)")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")


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


def collective_stats(compiled_or_hlo_text) -> dict[str, dict[str, int]]:
    """Count collectives and their result bytes (per device) in optimised HLO text or a `jax.stages.Compiled`.

    Async pairs count once, at `X-start`, with the bytes of `X-done`'s result: a `-start` result bundles the
    operand and scratch with the output. Counts are static: an op inside a while loop body counts once.
    """
    text = compiled_or_hlo_text if isinstance(compiled_or_hlo_text, str) else compiled_or_hlo_text.as_text()
    stats = {kind: dict(count=0, bytes=0) for kind in COLLECTIVE_KINDS}
    starts: dict[str, tuple[str, str]] = {}  # start name -> (kind, shape) until its done is seen
    for line in text.splitlines():
        inst = _INSTRUCTION.match(line)
        if not inst:
            continue
        shape, tail = _split_shape(inst.group("rest"))
        op = _OPCODE.match(tail)
        if not op:
            continue
        opcode = op.group("op")
        if opcode in COLLECTIVE_KINDS:
            stats[opcode]["count"] += 1
            stats[opcode]["bytes"] += shape_bytes(shape)
        elif opcode.endswith("-start") and opcode[: -len("-start")] in COLLECTIVE_KINDS:
            kind = opcode[: -len("-start")]
            stats[kind]["count"] += 1
            starts[inst.group("name")] = (kind, shape)
        elif opcode.endswith("-done") and opcode[: -len("-done")] in COLLECTIVE_KINDS:
            start = _OPERAND_NAME.search(op.group("operands"))  # the first operand is the matching -start
            if start and start.group(1) in starts:
                kind, _ = starts.pop(start.group(1))
                stats[kind]["bytes"] += shape_bytes(shape)
    for kind, shape in starts.values():  # a start without a visible done: best guess from its own shape
        elements = _tuple_elements(shape) if shape.startswith("(") else [shape]
        # all-gather-start: (operand, output); collective-permute-start: (operand, output, u32 contexts...)
        stats[kind]["bytes"] += shape_bytes(elements[1] if len(elements) > 1 else elements[0])
    return stats
