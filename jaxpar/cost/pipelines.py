"""`explain` for a pipelined trainer (a `jaxpar.pipeline.Pipeline` on a mesh with stage > 1): the schedule's ticks,
bubble and stage traffic read from the compiled step, against theory.

- Ticks. A schedule is a `lax.scan` of ticks: in the compiled step, a while loop whose body holds the
  collective-permutes over the stage axis (GPipe and circular: a forward loop and the backward loop autodiff makes
  of it; 1F1B: one loop, whose ticks are a forward and a backward half-step). Its trip count (`jaxpar.cost.hlo`)
  is the compiled tick count, against `Pipeline.ticks(S)`: R M + S - 1 (each loop of the forward schedules; 1F1B's
  one loop, R = 1).
- Bubble: the idle ticks of a stage over its ticks, with the compiled tick count as the denominator and the useful
  ticks a stage has: R M chunk runs of a forward loop (GPipe, circular), M ticks of 1F1B (each with one of its M
  forwards and one of its M backwards). Theory `Pipeline.bubble(S)`: (S - 1) / (R M + S - 1).
- Stage traffic: the bytes the busiest device sends through the ticks' collective-permutes in one step (each
  times its loops' trip counts), against theory from the batch and the model: A = the activation of one microbatch
  on one device (rows of a microbatch per device x the stack's activation shape x its dtype's bytes, the stack's
  input read by tracing the loss abstractly), 1 A per forward tick and 1 A per backward tick (GPipe, circular; a
  middle stage sends both ways, so 2 (R M + S - 1) A), 2 A per 1F1B tick (after its forward half-step one right,
  after its backward one left: 2 (M + S - 1) A), times `grad_accum`. With S = 2 and no ring each stage sends one
  way only, half of that.
- Everything else over the stage axis is listed apart, not folded into the theory: sums over the stages (the loss,
  the gradients of the layers outside the stack, the stack input's gradient), the last stage's outputs sent back,
  and under circular the stacked parameters (kept in layer order) re-cut into each stage's chunks and back.
"""
from __future__ import annotations

import math
import re

import jax
import numpy as np

from jaxpar.cost.hlo import bytes_sent
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.pipeline.config import ONE_F_ONE_B, Pipeline

STAGE = mesh_lib.STAGE_AXIS


def pipelined(trainer) -> bool:
    return isinstance(getattr(trainer, "pipeline", None), Pipeline) and mesh_lib.size(trainer.mesh, STAGE) > 1


def stack_input(trainer, batch):
    """The `ShapeDtypeStruct` of what the model's `Stack` is called with on `batch` (the whole global batch, one
    accumulation step not split off), by tracing the loss abstractly with the stack recording its input (`Capture`);
    None if nothing reaches a Stack."""
    from flax import nnx

    from jaxpar.pipeline.split import Capture
    from jaxpar.pipeline.stack import stacks
    from jaxpar.train.step import call_loss, make_rngs

    state = trainer.abstract_state(neutral=True)
    ctx = trainer.ctx

    def capture(params, model_state, batch):
        model = nnx.merge(ctx.graphdef, params, model_state)
        record = Capture()
        for stack in stacks(model):
            stack.tap = record
        call_loss(ctx.loss_fn, model, batch, make_rngs(jax.random.key(0)))
        return record.x

    strip = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
    return jax.eval_shape(capture, strip(state.params), strip(state.model_state), strip(batch))


def _stage_of(mesh):
    """Device id -> its coordinate on the stage axis."""
    index = list(mesh.axis_names).index(STAGE)
    return lambda device: int(np.unravel_index(device, mesh.devices.shape)[index])


def _direction(op, stage_of, stages: int) -> str:
    """"right" (to the next stage, the last to the first in a ring), "left" (the reverse) or "both" (a ring of two
    stages, where right and left are the same pairs)."""
    if stages == 2:  # 0 -> 1 is right and 1 -> 0 left, unless both are there (a ring)
        right = any(stage_of(t) > stage_of(s) for s, t in op.pairs)
        left = any(stage_of(t) < stage_of(s) for s, t in op.pairs)
    else:
        right = sum(stage_of(t) == (stage_of(s) + 1) % stages for s, t in op.pairs)
        left = sum(stage_of(t) == (stage_of(s) - 1) % stages for s, t in op.pairs)
        right, left = right > left, left > right
    return "right" if right and not left else "left" if left and not right else "both"


def tick_permutes(ops) -> list:
    """The collective-permutes over the stage axis that run in a schedule's ticks: those whose innermost loop is a
    tick loop, i.e. the innermost loop of some permute over stage that encloses no other such loop (a gradient
    accumulation loop around the ticks holds permutes of its own, e.g. the last stage's outputs, and is not one)."""
    over_stage = [op for op in ops if op.kind == "collective-permute" and op.axes == (STAGE,) and op.loops]
    innermost = {op.loops[-1][0] for op in over_stage}
    outer = {name for op in over_stage for name, _ in op.loops[:-1]}
    return [op for op in over_stage if op.loops[-1][0] in innermost - outer]


def _busiest(ops, devices: int) -> float:
    """Bytes the busiest device sends through `ops` (collective-permutes) in one step."""
    sent = np.zeros(devices)
    for op in ops:
        for source, _ in op.pairs:
            sent[source] += op.bytes * op.runs
    return float(sent.max()) if len(ops) else 0.0


def _theory(pipeline: Pipeline, stages: int, activation: int | None, accum: int) -> tuple[float | None, str]:
    """(bytes the busiest device sends over stage in one step, how) from the schedule and A."""
    r, s = pipeline.rounds, stages
    ring = pipeline.schedule != ONE_F_ONE_B and r > 1
    ways = 2 if s > 2 or ring else 1  # a middle stage (or any stage of a ring) sends both ways
    if pipeline.schedule == ONE_F_ONE_B:
        what = (f"2 A per tick (one right after the forward half-step, one left after the backward) x "
                f"{pipeline.ticks(s)} ticks (M + S - 1)")
    else:
        what = (f"1 A per forward tick + 1 A per backward tick, x {pipeline.ticks(s)} ticks "
                f"({'R M' if r > 1 else 'M'} + S - 1)")
    if ways == 1:
        what += "; with 2 stages and no ring each stage sends one way only: half"
    if accum > 1:
        what += f"; x grad_accum {accum}"
    if activation is None:
        return None, what
    return float(ways * pipeline.ticks(s) * activation * accum), what


def report(trainer, batch, ops) -> dict | None:
    """The pipeline section of one compiled variant's `explain` entry (None when nothing is pipelined)."""
    if not pipelined(trainer):
        return None
    mesh, pipeline = trainer.mesh, trainer.pipeline
    stages, accum = mesh_lib.size(mesh, STAGE), trainer.grad_accum
    m, r = pipeline.microbatches, pipeline.rounds
    stage_of = _stage_of(mesh)
    permutes = tick_permutes(ops)
    loops: dict = {}
    for op in permutes:  # a schedule loop: the innermost loop around a permute over stage
        name, trip = op.loops[-1]
        loop = loops.setdefault(name, {"name": name, "ticks": trip, "starts": op.runs // (trip or 1),
                                       "permutes": 0, "directions": []})
        loop["permutes"] += 1
        loop["directions"].append(_direction(op, stage_of, stages))
    ticks = sorted({loop["ticks"] for loop in loops.values()}, key=lambda t: (t is None, t))
    compiled_ticks = ticks[0] if ticks else None
    useful = r * m
    out = {"schedule": pipeline.schedule, "stages": stages, "microbatches": m, "repeats": r, "grad_accum": accum,
           "loops": list(loops.values()), "ticks": compiled_ticks, "ticks_theory": pipeline.ticks(stages),
           "useful_ticks": useful, "bubble_theory": pipeline.bubble(stages),
           "bubble": None if not compiled_ticks else (compiled_ticks - useful) / compiled_ticks}
    activation = None
    try:
        x = stack_input(trainer, batch)
    except Exception as error:  # noqa: BLE001 - a model explain cannot trace abstractly: no theory, said so
        x, out["activation_note"] = None, f"the stack's input could not be traced ({type(error).__name__})"
    if x is not None:
        ways = accum * m * mesh_lib.batch_ways(mesh)
        rows = x.shape[0] / ways
        activation = int(rows * math.prod(x.shape[1:]) * np.dtype(x.dtype).itemsize)
        out["activation"] = {"bytes": activation, "rows": rows, "shape": list(x.shape[1:]), "dtype": str(x.dtype)}
    # the stage inputs a device keeps for its backward: 1F1B's stash holds S whatever M, the forward schedules keep
    # one per forward tick
    out["kept_inputs"] = stages if pipeline.schedule == ONE_F_ONE_B else pipeline.ticks(stages)
    out["kept_inputs_gpipe"] = m + stages - 1
    out["stage_bytes"] = _busiest(permutes, mesh.size)
    out["stage_bytes_theory"], out["stage_theory_what"] = _theory(pipeline, stages, activation, accum)
    ticked = {id(op) for op in permutes}
    others: dict = {}
    for op in ops:
        if id(op) in ticked or STAGE not in (op.axes or ()):
            continue
        source = re.sub(r"^jit\([^)]*\)/", "", op.op_name)
        key = (op.kind, "+".join(op.axes), op.group, source)
        entry = others.setdefault(key, {"kind": op.kind, "axes": key[1], "group": op.group, "from": source,
                                        "count": 0, "bytes": 0, "bytes_sent_per_device": 0.0})
        entry["count"] += op.runs
        entry["bytes"] += op.bytes * op.runs
        entry["bytes_sent_per_device"] += bytes_sent(op)
    out["other"] = sorted(others.values(), key=lambda e: (e["kind"], e["axes"], e["from"]))
    return out


_BUBBLE = {"gpipe": "(S-1)/(M+S-1)", "circular": "(S-1)/(R M+S-1)", ONE_F_ONE_B: "(S-1)/(M+S-1)"}
_TICKS = {"gpipe": "M+S-1", "circular": "R M+S-1", ONE_F_ONE_B: "M+S-1"}


def lines(p: dict) -> list[str]:
    """The text of a pipeline section (`format_explain`)."""
    accum = f", grad_accum {p['grad_accum']}" if p["grad_accum"] > 1 else ""
    out = [f"  pipeline {p['schedule']} over stage={p['stages']}: S={p['stages']}, M={p['microbatches']}, "
           f"R={p['repeats']}{accum}"]
    if p["loops"]:
        described = []
        for loop in p["loops"]:
            ticks = "unknown (counted once)" if loop["ticks"] is None else f"{loop['ticks']}"
            directions = ", ".join(loop["directions"])
            described.append(f"{ticks} ticks x {loop['permutes']} stage permute(s) ({directions})")
        out.append(f"    ticks (compiled while loops holding the stage permutes): {'; '.join(described)}; theory "
                   f"Pipeline.ticks({p['stages']}) = {_TICKS[p['schedule']]} = {p['ticks_theory']}"
                   + (" per loop (forward, backward)" if p["schedule"] != ONE_F_ONE_B else ""))
    else:
        out.append("    ticks: no while loop holding collective-permutes over stage was found in the compiled step")
    if p["bubble"] is not None:
        useful = "R M" if p["repeats"] > 1 else "M"
        idle = p["ticks"] - p["useful_ticks"]
        out.append(f"    bubble (compiled): {idle} idle of {p['ticks']} ticks ({useful} = {p['useful_ticks']} "
                   f"useful) = {p['bubble']:.4f}; theory {_BUBBLE[p['schedule']]} = {p['bubble_theory']:.4f}")
    act = p.get("activation")
    kept = f"{p['kept_inputs']} stage inputs"
    if act:
        kept += f" = {p['kept_inputs'] * act['bytes']:,} bytes"
    versus = (f"; GPipe keeps M+S-1 = {p['kept_inputs_gpipe']} ({p['kept_inputs'] / p['kept_inputs_gpipe']:.2f} of it)"
              if p["schedule"] == ONE_F_ONE_B else " (one per forward tick)")
    out.append(f"    activations kept for the backward per device (theory): {kept}{versus}")
    theory = p["stage_bytes_theory"]
    if theory:
        ratio = f"; measured / theory {p['stage_bytes'] / theory:.3f}"
        a = (f"A = {act['bytes']:,} bytes: {act['rows']:g} rows x {tuple(act['shape'])} {act['dtype']} per "
             f"microbatch on a device")
        out.append(f"    stage traffic (the ticks' collective-permutes, busiest device, per step): "
                   f"{p['stage_bytes']:,.0f} bytes; theory {p['stage_theory_what']} = {theory:,.0f} ({a}){ratio}")
    else:
        why = p.get("activation_note", "no jaxpar.pipeline.Stack input found")
        out.append(f"    stage traffic (the ticks' collective-permutes, busiest device, per step): "
                   f"{p['stage_bytes']:,.0f} bytes; no theory: {why}")
    for o in p["other"]:
        out.append(f"    also over {o['axes']}, outside the ticks: {o['kind']} (g={o['group']}) x {o['count']}: "
                   f"{o['bytes']:,} bytes, sent {o['bytes_sent_per_device']:,.0f} (from {o['from'] or '?'})")
    return out
