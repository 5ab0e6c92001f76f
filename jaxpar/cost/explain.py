"""`jaxpar.explain(trainer, batch)`: where memory, communication and time go, before a single step runs.

Everything is read from the trainer's own shardings and from its step variants compiled ahead of time (nothing is
allocated, nothing trains):

- the sharding plan (`sharding_layout.py`): every parameter's shape, partition spec and bytes per device;
  per-device totals of parameters, optimizer state, strategy state and communicator state, split into replicated
  and sharded bytes;
- per compiled step variant: XLA's memory analysis (arguments, outputs, temporaries) against a device's memory;
- per variant: its collectives grouped by kind and mesh axes (count, result bytes and bytes sent per device), next
  to what theory says the strategy and mesh should send, and a flag on anything theory does not explain
  (`expected_traffic.py`);
- FLOPs per step (XLA's cost analysis, with every while body counted its trip count times: `jaxpar.cost.hlo.
  loop_flops`) and the model FLOPs per token (6 x parameters, the usual forward + backward estimate) where the
  batch holds tokens;
- collectives per step: an op inside a while loop (a pipeline's ticks, gradient accumulation) counts as many times
  as the loops around it run (`jaxpar.cost.hlo`); the line says how many ops and loops it came from;
- for a pipelined trainer: the schedule's ticks, bubble and stage traffic from the compiled step against theory
  (`jaxpar.cost.pipelines`);
- with a hardware profile: each variant's projected compute and communication seconds (`jaxpar.cost.hardware`), and a
  projected mean step time for every strategy, marked as a projection.

The report's text is `explain_text.format_explain`.
"""
from __future__ import annotations

import math

import numpy as np

from jaxpar.cost import context_traffic, memory_fit, pipelines, strategy_costs
from jaxpar.cost.expected_traffic import expected, theory
from jaxpar.cost.explain_text import format_explain  # noqa: F401 - jaxpar.cost.explain.format_explain, as documented
from jaxpar.cost.hardware import collective_seconds
from jaxpar.cost.hlo import bytes_sent, collective_ops, loop_flops, unknown_loops
from jaxpar.cost.sharding_layout import sharding_layout
from jaxpar.cost.step_pricer import profile_of
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.runtime.resources import device_memory, step_bytes, step_flops
from jaxpar.strategies import REGISTRY

DATA = mesh_lib.DATA


def _variants(trainer) -> dict[str, dict]:
    """The step variants the strategy runs, with the inputs of one step of each and its share of the steps."""
    strategy, ctx = trainer.strategy, trainer.ctx
    first = strategy.plan(ctx, 0)
    shares = strategy_costs.variant_shares(strategy, ctx)
    inputs = {variant: first.inputs if first.variant == variant else {} for variant in shares}
    return {v: {"inputs": inputs[v], "share": shares[v]} for v in shares}


def _communication(ops, variant, trainer, profile) -> list[dict]:
    groups: dict = {}
    for op in ops:
        key = (op.kind, "+".join(op.axes) if op.axes else "-", op.group)
        entry = groups.setdefault(key, {"kind": op.kind, "axes": key[1], "group": op.group, "count": 0, "bytes": 0,
                                        "bytes_sent_per_device": 0.0, "unexpected": 0, "ops": 0, "loops": {}})
        entry["ops"] += 1  # ops in the program; count, bytes and bytes sent are per step (times their loops' runs)
        entry["count"] += op.runs
        entry["bytes"] += op.bytes * op.runs
        entry["bytes_sent_per_device"] += bytes_sent(op)
        entry["unexpected"] += not expected(op, variant, trainer)
        if op.loops:  # trips of the loops around it, outermost first ("?": unknown, counted once) -> ops
            trips = " x ".join("?" if trip is None else str(trip) for _, trip in op.loops)
            entry["loops"][trips] = entry["loops"].get(trips, 0) + 1
        if profile is not None:
            entry["seconds"] = entry.get("seconds", 0.0) + collective_seconds(op, profile)
    return sorted(groups.values(), key=lambda e: (e["axes"], e["kind"]))


def busiest_sent(ops, devices: int) -> dict:
    """Per mesh axis, the bytes the busiest device sends over it in one step: a ring algorithm's share for group
    collectives (`jaxpar.cost.hlo.bytes_sent`), and for a collective-permute only its sources (a parameter server's
    root sends (N-1) x B while every other replica sends B); an op in a loop as many times as it runs."""
    per_axis: dict = {}
    for op in ops:
        for axis in op.axes or ():
            sent = per_axis.setdefault(axis, np.zeros(devices))
            if op.kind == "collective-permute":
                for source, _ in op.pairs:
                    sent[source] += op.bytes * op.runs
            else:
                sent += bytes_sent(op)
    return {axis: float(sent.max()) for axis, sent in per_axis.items()}


def _tokens(batch) -> int | None:
    """Tokens of a batch whose input is a 2-D integer array (a language model's), else None."""
    for value in batch.values():
        dtype = getattr(value, "dtype", None)
        if dtype is not None and np.dtype(dtype).kind in "iu" and len(value.shape) == 2:
            return int(value.shape[0] * value.shape[1])
    return None


def explain(trainer, batch, blocks: int | None = None, fit: bool = False, compiled: dict | None = None) -> dict:
    """The plan, memory, communication and FLOPs of `trainer`'s steps on global batches shaped like `batch` (arrays
    or `jax.ShapeDtypeStruct`s), as a dict; `blocks`: transformer blocks, for the tensor-parallel expectation.
    With a hardware profile (`Trainer(hardware=...)`), projected seconds too. Compiles each step variant once; runs nothing.
    `fit`: also what fits a device (`jaxpar.cost.memory_fit.what_fits`: every remat policy at two batch sizes,
    compiled, and the suggested policy and batch), under the key "fit". `compiled`: {variant: its compiled step}
    already compiled for `batch` (`jaxpar.plan` compiles its meshes at once); the others are compiled here."""
    profile, mesh = profile_of(trainer), trainer.mesh
    out = {"mesh": dict(mesh.shape), "devices": int(mesh.size), "strategy": trainer.strategy.name,
           "device_memory": device_memory(mesh), "plan": sharding_layout(trainer), "variants": {},
           "hardware": None if profile is None else {"name": profile.name, "describe": profile.describe(),
                                                     "source": profile.source, "overlap": profile.overlap}}
    parameters = sum(math.prod(p["shape"]) for p in out["plan"]["parameters"])
    tokens = _tokens(batch)
    out["parameters"] = parameters
    assumed = strategy_costs.assumption(trainer.strategy)  # a strategy the cost table does not know
    if assumed:
        out["assumed"] = assumed
    out["model_flops_per_token"] = 6 * parameters if tokens else None
    for variant, facts in _variants(trainer).items():
        given = (compiled or {}).get(variant)
        program = given if given is not None else trainer.compiled_step(variant, batch, facts["inputs"])
        ops = collective_ops(program, mesh)
        counted = loop_flops(program, step_flops(program))
        flops = counted.per_device
        entry = {"share": facts["share"], "memory": step_bytes(program),
                 "flops_per_device": flops, "flops": None if flops is None else flops * mesh.size,
                 "xla_flops_per_device": counted.xla, "flops_note": counted.note,
                 "unknown_loops": unknown_loops(ops), "pipeline": pipelines.report(trainer, batch, ops),
                 "context": context_traffic.report(trainer, batch, ops),
                 "communication": _communication(ops, variant, trainer, profile),
                 "busiest_sent": busiest_sent(ops, mesh.size),
                 "theory": theory(trainer, variant, blocks, batch)}
        entry["unexpected"] = sum(c["unexpected"] for c in entry["communication"])
        if tokens and flops:
            entry["flops_per_token"] = flops * mesh.size / tokens
        if profile is not None:
            cost = trainer.pricer.price(variant, program)
            entry["projected_seconds"] = {"compute": cost.compute, "communication": cost.comm,
                                          "overlap": cost.overlap, "step": cost.compute + cost.exposed}
        out["variants"][variant] = entry
    if profile is not None:
        out["projection"] = project(out["variants"], trainer)
    if fit:
        hungriest = max(out["variants"], key=lambda v: (out["variants"][v]["memory"] or {}).get("total", 0))
        out["fit"] = memory_fit.what_fits(trainer, batch, hungriest, _variants(trainer)[hungriest]["inputs"])
    return out


def _exchange_seconds(entry) -> tuple[float, float]:
    """(seconds of collectives over the data axis, seconds of the rest) of a compiled variant."""
    over_data = sum(c.get("seconds", 0.0) for c in entry["communication"] if DATA in c["axes"].split("+"))
    return over_data, entry["projected_seconds"]["communication"] - over_data


def project(variants: dict, trainer) -> dict:
    """Projected mean seconds per step of each strategy, from this trainer's compiled variants: its own exactly (the
    variants weighted by their share of steps); the others from the parts of its exchanging variant (compute, the
    collectives within a replica, the exchange over data) and its local variant if it has one (else a local step is
    taken to be compute and within-replica collectives only), with no stragglers. Each strategy prices its own
    pattern (`project`)."""
    own = trainer.strategy
    result = {own.name: {"seconds": sum(v["projected_seconds"]["step"] * (v["share"] or 0)
                                        for v in variants.values()),
                         "how": "this run's compiled variants, weighted by their share of steps"}}
    exchanging = [name for name in variants if strategy_costs.theory(own, name, 0)]
    if not exchanging:
        return result
    full_entry = variants[exchanging[0]]
    over_data, _ = _exchange_seconds(full_entry)
    full = full_entry["projected_seconds"]["step"]
    quiet = [name for name in variants if not strategy_costs.theory(own, name, 0)]
    hidden = full_entry["projected_seconds"].get("overlap", 0.0)  # only the exchange over data was hidden
    local = variants[quiet[0]]["projected_seconds"]["step"] if quiet else full - over_data + hidden
    # a meeting averages parameters after its step, so none of its exchange hides under the backward pass: a
    # sync run's step without its overlap (a periodic run's own meeting step already has none)
    meeting = full if quiet else full + hidden
    for name, cls in REGISTRY.items():
        if name != own.name:
            periodic = strategy_costs.periodic(cls)  # local SGD, DiLoCo: they meet every H steps
            seconds, how = strategy_costs.project(cls, meeting if periodic else full, local,
                                                  strategy_costs.period(own))
            result[name] = {"seconds": seconds, "how": how}
    return result


