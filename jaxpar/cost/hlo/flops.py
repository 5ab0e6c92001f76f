"""FLOPs of a compiled step with every while loop counted as many times as it runs.

XLA's cost analysis (`compiled.cost_analysis()`) counts a while body's FLOPs once, whatever its trip count
(measured: a scan of 1, 2, 5 or 10 matmuls reports the same FLOPs). `loop_flops` adds the missing (K - 1) runs of
every counted loop body, costing each body with XLA's own cost analysis.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from jaxpar.cost.hlo.program import Program, hlo_text, parse_program
from jaxpar.pipeline.schedules import ALTERNATING, TAKEN

_CONDITIONAL = re.compile(r"=\s*\S.*?\sconditional\(")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"\b(true|false)_computation=%?([\w.\-]+)")
_TAKEN = re.compile(TAKEN + r"_(\d+)_of_(\d+)/cond\"")


class Flops(NamedTuple):
    """FLOPs of one step on one device."""

    per_device: float | None  # every while body counted its trip count times (None: the backend gives no count)
    xla: float | None  # XLA's cost analysis as it stands: each while body once
    note: str = ""  # how the loops were counted, when that changed anything or could not be done


def loop_flops(compiled_or_hlo_text, xla_flops: float | None) -> Flops:
    """`xla_flops` (XLA's cost analysis of the whole step, which counts a while body once) plus, for every while loop
    with a known trip count K, the K - 1 runs it left out: K - 1 times its body's FLOPs, costed by XLA's own cost
    analysis of the body alone (nested loops multiply).

    Conditionals, the rule: a conditional counts its branches as often as they run on the busiest device. XLA counts
    its costliest branch every time; the pipeline schedules say otherwise by name scope (`_weighted`): 1F1B's
    half-step conditional (`jaxpar.pipeline.schedules.ALTERNATING`) runs its forward branch in half of the
    half-steps and its backward in the other half, so it counts their mean; the head and the first stage's part
    (`TAKEN`) run in the ticks that carry a microbatch only (M of the loop's ticks), the empty branch otherwise.

    A loop without a known trip count is counted once (see `note`); if the bodies cannot be costed (the HLO parser
    of this jaxlib missing), `xla_flops` is returned as it is."""
    if not xla_flops:
        return Flops(None, None)
    program = parse_program(hlo_text(compiled_or_hlo_text))
    if not program.whiles or program.entry is None:
        return Flops(xla_flops, xla_flops)
    try:
        costed = _body_costs(program)
    except Exception as error:  # noqa: BLE001 - private XLA bindings: any failure leaves XLA's count
        return Flops(xla_flops, xla_flops, f"while bodies counted once (their cost could not be read: "
                                           f"{type(error).__name__})")
    unknown = sorted(name for name, (_, _, trip) in program.whiles.items() if trip is None)
    total = xla_flops + _extra(program, program.entry, costed, {})
    weighted = _weighted(program, costed)
    total += weighted
    note = "every while body counted its trip count times (XLA's cost analysis counts it once)"
    if weighted:
        note += ("; the pipeline's conditionals by how often each branch runs (1F1B's forward / backward half-steps "
                 "at their mean; the head and the first stage's part in their microbatches' ticks only)")
    if unknown:
        note += f"; {len(unknown)} loop(s) of unknown trip count counted once ({', '.join(unknown)})"
    total = float(round(total))  # (branch weights are fractions of runs: a whole number of FLOPs)
    return Flops(total, xla_flops, note if total != xla_flops or unknown else "")


def _branch_names(line: str, program: Program) -> list[str]:
    """A conditional's branch computations in index order (a boolean one's: false, then true)."""
    branches = _BRANCHES.search(line)
    if branches:
        names = [n.strip().lstrip("%") for n in branches.group(1).split(",")]
    else:
        named = dict(m.groups() for m in _TRUE_FALSE.finditer(line))
        names = [named.get("false"), named.get("true")]
    return [name for name in names if name in program.calls]


def _weights(line: str) -> list[float] | None:
    """How often each branch (index order) runs per run of a conditional under one of the schedules' rules, or None
    (its costliest branch every time, XLA's rule)."""
    if f'{ALTERNATING}/cond"' in line:
        return [0.5, 0.5]
    taken = _TAKEN.search(line)
    if taken:
        share = int(taken.group(1)) / int(taken.group(2))
        return [1.0 - share, share]
    return None


def _weighted(program: Program, costed) -> float:
    """What counting the schedules' conditionals by how often each branch runs changes (a negative number): 1F1B's
    half-step (its two branches in turn: their mean) and the head / first-stage conditionals (the true branch in
    `runs` of the `reached` ticks of their `TAKEN` scope; inside a half-step branch, that branch's half). The count
    so far holds, per run of such a conditional, its costliest branch's static FLOPs (XLA) plus the loops left out
    of every branch (`_extra`); it should hold the weighted sum over the branches of (static + left out)."""
    change, memo = 0.0, {}
    halved = set()  # what 1F1B's half-step branches run: each of them half of the half-steps
    for computation in program.order:
        for line in program.lines[computation]:
            if f'{ALTERNATING}/cond"' in line and _CONDITIONAL.search(line):
                for name in _branch_names(line, program):
                    halved |= _outside_loops(program, name)
    for computation in program.order:
        for line in program.lines[computation]:
            weights = _weights(line) if _CONDITIONAL.search(line) else None
            names = _branch_names(line, program) if weights else []
            if len(names) != len(weights or ()) or len(names) < 2:
                continue  # not a schedule's conditional (those inside its branches keep the costliest)
            static = [costed(name) for name in names]
            left_out = [_extra(program, name, costed, memo) for name in names]
            whole = sum(w * (a + b) for w, a, b in zip(weights, static, left_out))
            share = 0.5 if computation in halved and f'{ALTERNATING}/cond"' not in line else 1.0
            change += program.runs[computation] * share * (whole - max(static) - sum(left_out))
    return change


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
