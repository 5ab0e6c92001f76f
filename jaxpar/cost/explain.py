"""`jaxpar.explain(trainer, batch)`: where memory, communication and time go, before a single step runs.

Everything is read from the trainer's own shardings and from its step variants compiled ahead of time (nothing is
allocated, nothing trains):

- the sharding plan: every parameter's shape, partition spec and bytes per device; per-device totals of
  parameters, optimizer state, strategy state and communicator state, split into replicated and sharded bytes;
- per compiled step variant: XLA's memory analysis (arguments, outputs, temporaries) against a device's memory;
- per variant: its collectives grouped by kind and mesh axes (count, result bytes and bytes sent per device), next
  to what theory says the strategy and mesh should send, and a flag on anything theory does not explain;
- FLOPs per step (XLA's cost analysis, with every while body counted its trip count times: `jaxpar.cost.hlo.
  loop_flops`) and the model FLOPs per token (6 x parameters, the usual forward + backward estimate) where the
  batch holds tokens;
- collectives per step: an op inside a while loop (a pipeline's ticks, gradient accumulation) counts as many times
  as the loops around it run (`jaxpar.cost.hlo`); the line says how many ops and loops it came from;
- for a pipelined trainer: the schedule's ticks, bubble and stage traffic from the compiled step against theory
  (`jaxpar.cost.pipelines`);
- with a hardware profile: each variant's projected compute and communication seconds (`jaxpar.cost.hardware`), and a
  projected mean step time for every strategy, marked as a projection.

Why about 400 lines: the report and its text (`format_explain`) are one contract that scripts read line by line.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxpar.cost import fit as fitting
from jaxpar.cost import codecs, pipelines, topology
from jaxpar.cost.hardware import collective_seconds
from jaxpar.cost.hlo import bytes_sent, collective_ops, loop_flops, unknown_loops
from jaxpar.cost.step_pricer import profile_of
from jaxpar.names import named_leaves
from jaxpar.parallel import partitioning as shd
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.collectives import theoretical_traffic
from jaxpar.runtime.resources import device_memory, step_bytes, step_flops
from jaxpar.strategies import REGISTRY

DATA, STAGE, FSDP, MODEL = mesh_lib.DATA, mesh_lib.STAGE, mesh_lib.FSDP, mesh_lib.MODEL


def _spec(sharding) -> str:
    spec = getattr(sharding, "spec", ())
    return "(" + ", ".join("None" if e is None else (e if isinstance(e, str) else "+".join(e)) for e in spec) + ")"


def _itemsize(dtype) -> int:
    """Bytes of one element, PRNG key dtypes included (a threefry key is 8 bytes)."""
    return int(getattr(dtype, "itemsize", 0) or np.dtype(dtype).itemsize)


def _placed_bytes(tree) -> dict:
    """Per-device bytes of a tree of sharded ShapeDtypeStructs: total, replicated part, sharded part."""
    out = dict(total=0, replicated=0, sharded=0)
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shard = sharding.shard_shape(leaf.shape) if isinstance(sharding, NamedSharding) else leaf.shape
        size = math.prod(shard) * _itemsize(leaf.dtype)
        out["total"] += size
        out["sharded" if tuple(shard) != tuple(leaf.shape) else "replicated"] += size
    return out


def sharding_plan(trainer) -> dict:
    """Every parameter's placement and the per-device state totals."""
    state = trainer.abstract_state()
    params = []
    for name, leaf in named_leaves(state.params):  # named as checkpoints and errors name them
        shard = leaf.sharding.shard_shape(leaf.shape)
        itemsize = _itemsize(leaf.dtype)
        params.append({"name": name, "shape": list(leaf.shape), "dtype": str(leaf.dtype),
                       "spec": _spec(leaf.sharding), "bytes": math.prod(leaf.shape) * itemsize,
                       "bytes_per_device": math.prod(shard) * itemsize,
                       "splits": list(shd.within_replica_splits(leaf.sharding, leaf.ndim))})
    totals = {part: _placed_bytes(getattr(state, field)) for part, field in
              (("parameters", "params"), ("model_state", "model_state"), ("optimizer", "opt_state"),
               ("strategy", "strategy_state"), ("communicator", "comm_state"))}
    totals["all"] = {k: sum(t[k] for t in totals.values()) for k in ("total", "replicated", "sharded")}
    return {"parameters": params, "per_device": totals}


def _variants(trainer) -> dict[str, dict]:
    """The step variants the strategy runs, with the inputs of one step of each and its share of the steps."""
    strategy, ctx = trainer.strategy, trainer.ctx
    first = strategy.plan(ctx, 0)
    shares = strategy.variant_shares()
    inputs = {variant: first.inputs if first.variant == variant else {} for variant in shares}
    return {v: {"inputs": inputs[v], "share": shares[v]} for v in shares}


def _gradient_bytes(trainer) -> int:
    """Bytes of one replica's gradient on one device: its parameters' shards (float32 gradients of float params)."""
    return _placed_bytes(trainer.abstract_state(neutral=True).params)["total"]


def _fsdp_group_bytes(trainer) -> int:
    """P_f: what one fsdp group gathers, = fsdp size x the shard of every fsdp-sharded parameter on one device."""
    n = mesh_lib.size(trainer.mesh, FSDP)
    total = 0
    for leaf in jax.tree.leaves(trainer.abstract_state(neutral=True).params):
        spec = [(e,) if isinstance(e, str) else tuple(e or ()) for e in leaf.sharding.spec]
        if any(FSDP in axes for axes in spec):
            total += n * math.prod(leaf.sharding.shard_shape(leaf.shape)) * _itemsize(leaf.dtype)
    return total


_ALGORITHM_LABELS = {"psum": "bandwidth-optimal all-reduce, 2(N-1)/N x B", "ring": "ring, 2(N-1)/N x B",
                     "torus2d": "2D torus, 2(N-1)/N x B",
                     "ps": "parameter server: the root receives and sends (N-1) x B"}


def theory(trainer, variant: str, blocks: int | None = None, batch=None) -> list[dict]:
    """What the strategy and mesh should send per device in one step of `variant`, line by line: the strategy's
    exchanges over the replica axis (`strategy.theory`), ZeRO-3 over fsdp (its gradient third the codec's fsdp leg
    where one applies to global batches shaped like `batch`: `codecs.fsdp_leg`), tensor parallelism over model."""
    mesh, strategy = trainer.mesh, trainer.strategy
    n = mesh_lib.replica_count(mesh)
    communicator = strategy.communicator
    algorithm = communicator.name if communicator is not None else "psum"
    torus_x = getattr(communicator, "torus_x", None)
    lines = []
    for expected in (strategy.theory(trainer.ctx, variant, _gradient_bytes(trainer)) if n > 1 else []):
        grad = expected.bytes
        t = theoretical_traffic(algorithm, n, grad, torus_x)
        grid = topology.torus_note(strategy, mesh, profile_of(trainer))
        line = {"axis": DATA, "what": f"{expected.what} averaged over {n} replicas ({_ALGORITHM_LABELS[algorithm]}; "
                f"B = {grad:,} bytes{'; ' + grid if grid else ''})",
                "bytes_sent_per_device": t["bytes_sent_per_device"], "steps": t["steps"]}
        if expected.kind == "ps":
            line["bytes_sent_per_device"] = (n - 1) * grad  # the root's traffic, the bottleneck
        coded = codecs.report(trainer, line["bytes_sent_per_device"])
        if coded:  # the codec's bytes are what crosses the wire; float32's stay in the words and the report
            line["what"] += (f"; compressed by {coded['name']}: {coded['theory']}; "
                             f"{coded['bytes_sent_per_device']:,.0f} bytes against float32's "
                             f"{coded['float32_bytes']:,.0f} ({coded['ratio']:.3f})")
            line.update(bytes_sent_per_device=coded["bytes_sent_per_device"], steps=coded["steps"], codec=coded)
        if expected.share < 1:
            line["per_step_over_period"] = line["bytes_sent_per_device"] * expected.share
            line["what"] += f"; once every {round(1 / expected.share)} steps"
        lines.append(line)
    f = mesh_lib.size(mesh, FSDP)
    if f > 1:
        pf = _fsdp_group_bytes(trainer)
        leg = codecs.fsdp_leg(trainer, variant, batch)
        if leg is None:
            lines.append({"axis": FSDP, "what": f"ZeRO-3 over fsdp={f}: all-gather parameters (forward, backward) and "
                          f"reduce-scatter gradients, 3 x (F-1)/F x P_f (P_f = {pf:,} bytes)",
                          "bytes_sent_per_device": 3 * (f - 1) / f * pf, "steps": 3 * (f - 1)})
        else:  # the gradient's third is the codec's leg (jaxpar.parallel.fsdp_reduce), written by jaxpar
            lines.append({"axis": FSDP, "what": f"ZeRO-3 over fsdp={f}: all-gather parameters (forward, backward), "
                          f"2 x (F-1)/F x P_f (P_f = {pf:,} bytes); {codecs.fsdp_leg_text(leg)}",
                          "bytes_sent_per_device": 2 * (f - 1) / f * pf + leg["bytes_sent_per_device"],
                          "steps": 2 * (f - 1) + leg["steps"], "fsdp_leg": leg})
    m = mesh_lib.size(mesh, MODEL)
    if m > 1:
        line = {"axis": MODEL, "what": f"tensor parallel over model={m}: activation all-reduces (Megatron: 2 in the "
                f"forward and 2 in the backward pass per transformer block)"}
        if blocks:
            line["all_reduces"] = 4 * blocks
            line["what"] += f"; {blocks} blocks -> {4 * blocks}"
        lines.append(line)
    return lines


def _expected(op, variant: str, trainer) -> bool:
    """Whether theory explains a collective: an unexpected one (e.g. an all-gather over data) is flagged."""
    axes = set(op.axes or ())
    communicator = trainer.strategy.communicator
    explicit = communicator is not None and not communicator.native
    local = not trainer.strategy.theory(trainer.ctx, variant, 0)  # a variant that exchanges nothing over data
    if DATA in axes and local:
        # a local step sends nothing between replicas; with several processes, only its scalar metric means
        return op.bytes <= 64 and op.kind == "all-reduce" and jax.process_count() > 1
    if op.bytes <= 64 and op.kind == "all-reduce":
        return True  # scalars: metric means and the non-finite flag
    if STAGE in axes and pipelines.pipelined(trainer):
        # the ticks' permutes, sums over the stages, the last stage's outputs sent back; under circular, the
        # stacked parameters re-cut into each stage's chunks (all-to-all / permutes) and their gradients back
        if op.kind in ("collective-permute", "all-reduce"):
            return True
        if op.kind == "all-to-all" and trainer.pipeline.rounds > 1:
            return True
    if DATA in axes:
        if op.kind == "all-reduce":
            return not local
        if op.kind == "collective-permute":
            return explicit and not local
        if op.kind in ("all-gather", "all-to-all") and codecs.codec_of(communicator) is not None:
            return not local  # int8's codes are all-gathered; under psum a 16-bit sum is all-to-all + all-gather
        return op.kind == "reduce-scatter" and FSDP in axes  # gradients over data and fsdp in one op
    if FSDP in axes:  # a codec's fsdp leg sends its blocks by all-to-all (jaxpar.parallel.fsdp_reduce)
        return op.kind in ("all-gather", "reduce-scatter", "all-reduce") or (
            op.kind == "all-to-all" and getattr(communicator, "codec", None) is not None)
    if MODEL in axes:
        return op.kind in ("all-reduce", "all-gather", "reduce-scatter")
    return False


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
        entry["unexpected"] += not _expected(op, variant, trainer)
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
    With a hardware profile (`Trainer(hardware=...)`), projected seconds too. Compiles each step variant once; runs
    nothing.
    `fit`: also what fits a device (`jaxpar.cost.fit.advise`: every remat policy at two batch sizes, compiled, and
    the suggested policy and batch), under the key "fit". `compiled`: {variant: its compiled step} already
    compiled for `batch` (`jaxpar.plan` compiles its meshes at once); the others are compiled here."""
    profile, mesh = profile_of(trainer), trainer.mesh
    out = {"mesh": dict(mesh.shape), "devices": int(mesh.size), "strategy": trainer.strategy.name,
           "device_memory": device_memory(mesh), "plan": sharding_plan(trainer), "variants": {},
           "hardware": None if profile is None else {"name": profile.name, "describe": profile.describe(),
                                                     "source": profile.source, "overlap": profile.overlap}}
    parameters = sum(math.prod(p["shape"]) for p in out["plan"]["parameters"])
    tokens = _tokens(batch)
    out["parameters"] = parameters
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
        out["fit"] = fitting.advise(trainer, batch, hungriest, _variants(trainer)[hungriest]["inputs"])
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
    own, ctx = trainer.strategy, trainer.ctx
    result = {own.name: {"seconds": sum(v["projected_seconds"]["step"] * (v["share"] or 0)
                                        for v in variants.values()),
                         "how": "this run's compiled variants, weighted by their share of steps"}}
    exchanging = [name for name in variants if own.theory(ctx, name, 0)]
    if not exchanging:
        return result
    full_entry = variants[exchanging[0]]
    over_data, _ = _exchange_seconds(full_entry)
    full = full_entry["projected_seconds"]["step"]
    quiet = [name for name in variants if not own.theory(ctx, name, 0)]
    hidden = full_entry["projected_seconds"].get("overlap", 0.0)  # only the exchange over data was hidden
    local = variants[quiet[0]]["projected_seconds"]["step"] if quiet else full - over_data + hidden
    # a meeting averages parameters after its step, so none of its exchange hides under the backward pass: a
    # sync run's step without its overlap (a periodic run's own meeting step already has none)
    meeting = full if quiet else full + hidden
    for name, cls in REGISTRY.items():
        if name != own.name:
            periodic = "sync_period" in getattr(cls, "OPTIONS", {})  # local SGD, DiLoCo: they meet every H steps
            seconds, how = cls.project(meeting if periodic else full, local, own.period)
            result[name] = {"seconds": seconds, "how": how}
    return result


def _fmt_bytes(n) -> str:
    return f"{n:,.0f}"


_OVERLAP_NOTE = {True: "the gradient all-reduce overlapping the backward pass (overlap)",
                 False: "no overlap of compute and communication"}


def format_explain(report: dict) -> str:
    """The human-readable text of an `explain` report."""
    mesh = " x ".join(f"{k}={v}" for k, v in report["mesh"].items())
    lines = [f"jaxpar explain: strategy {report['strategy']} on mesh {mesh} ({report['devices']} devices); "
             f"{report['parameters']:,} parameters; nothing was trained"]
    if report["model_flops_per_token"]:
        lines.append(f"model FLOPs per token: {report['model_flops_per_token']:,} (6 x parameters: forward and "
                     f"backward, the usual estimate; the compiled count per token is under each variant)")
    lines += ["", "sharding plan (per device):"]
    width = max((len(p["name"]) for p in report["plan"]["parameters"]), default=4)
    for p in report["plan"]["parameters"]:
        lines.append(f"  {p['name']:<{width}}  {str(p['shape']):<16} {p['spec']:<22} {p['bytes_per_device']:>12,} of "
                     f"{p['bytes']:,} bytes")
    for part, t in report["plan"]["per_device"].items():
        if t["total"] or part == "all":
            lines.append(f"  {part + ':':<14} {t['total']:>12,} bytes per device ({t['replicated']:,} replicated, "
                         f"{t['sharded']:,} sharded)")
    memory = report["device_memory"]
    for name, v in report["variants"].items():
        share = f", {v['share']:.3g} of the steps" if v["share"] is not None else ""
        lines += ["", f"step variant {name!r}{share}:"]
        m = v["memory"]
        if m:
            lines.append(f"  memory per device: {m['total']:,} bytes of {memory:,} (arguments {m['arguments']:,}, "
                         f"outputs {m['outputs']:,}, temporaries {m['temporaries']:,}, donated {m['donated']:,})")
        if v["flops"]:
            per_token = f"; {v['flops_per_token']:,.0f} per token" if v.get("flops_per_token") else ""
            loops = (f"; {v['flops_note']}: XLA's own count is {v['xla_flops_per_device']:,.0f} per device"
                     if v.get("flops_note") else "")
            lines.append(f"  FLOPs per step: {v['flops']:,.0f} on all devices ({v['flops_per_device']:,.0f} per "
                         f"device){per_token}{loops}")
        lines.append("  collectives (compiled HLO): kind over axes (group) x count: result bytes, sent per device")
        for c in v["communication"]:
            flag = f"   <- UNEXPECTED x{c['unexpected']}: not explained by the strategy and mesh" if c["unexpected"] else ""
            seconds = f", {c['seconds'] * 1e6:,.1f} us projected" if "seconds" in c else ""
            looped = ""
            if c.get("loops"):
                inside = ", ".join(f"{n} in loops of {trips} trips" for trips, n in c["loops"].items())
                looped = f" (per step: {c['ops']} op(s) in the program, {inside})"
            lines.append(f"    {c['kind']} over {c['axes']} (g={c['group']}) x {c['count']}: {_fmt_bytes(c['bytes'])}, "
                         f"sent {_fmt_bytes(c['bytes_sent_per_device'])}{seconds}{looped}{flag}")
        if not v["communication"]:
            lines.append("    none")
        if v["busiest_sent"]:
            lines.append("  sent by the busiest device: " + ", ".join(
                f"{_fmt_bytes(b)} bytes over {axis}" for axis, b in v["busiest_sent"].items()))
        for t in v["theory"]:
            expected = (f": {t['bytes_sent_per_device']:,.0f} bytes sent per device in {t['steps']} steps"
                        if "bytes_sent_per_device" in t else "")
            over = (f" ({t['per_step_over_period']:,.0f} per step averaged over the period)"
                    if "per_step_over_period" in t else "")
            lines.append(f"  theory, {t['axis']}: {t['what']}{expected}{over}")
            if "codec" in t:
                work = t["codec"]["flops"]
                lines.append(f"  codec {t['codec']['name']} compute: {sum(work.values()):,} FLOPs per device per "
                             f"step (" + ", ".join(f"{kind} {count:,}" for kind, count in work.items()) + ")")
            if t.get("fsdp_leg", {}).get("flops"):
                lines.append(f"  codec {t['fsdp_leg']['name']} compute on the fsdp leg: {t['fsdp_leg']['flops']:,} "
                             f"FLOPs per device per step (encode, decode and the float32 sum)")
        if v.get("unknown_loops"):
            lines.append(f"  while loops of unknown trip count, their collectives counted once per step: "
                         f"{', '.join(v['unknown_loops'])}")
        if v.get("pipeline"):
            lines += pipelines.lines(v["pipeline"])
        if "projected_seconds" in v:
            p = v["projected_seconds"]
            hidden = f" - overlap {p['overlap'] * 1e3:.4g} ms" if p.get("overlap") else ""
            lines.append(f"  PROJECTED on {report['hardware']['name']}: compute {p['compute'] * 1e3:.4g} ms + "
                         f"communication {p['communication'] * 1e3:.4g} ms{hidden} = {p['step'] * 1e3:.4g} ms per step")
    if "projection" in report:
        lines += ["", f"PROJECTED mean step time per strategy on {report['hardware']['describe']} (a projection "
                  f"from the alpha-beta cost model, not a measurement; "
                  f"{_OVERLAP_NOTE[report['hardware']['overlap']]}):"]
        for name, p in report["projection"].items():
            lines.append(f"  {name:<10} {p['seconds'] * 1e3:10.4g} ms   ({p['how']})")
        lines.append(f"  profile numbers: {report['hardware']['source']}")
    if "fit" in report:
        lines += fitting.lines(report["fit"])
    flagged = sum(v["unexpected"] for v in report["variants"].values())
    lines += ["", f"{flagged} collective(s) not explained by theory" + (
        " (an unexpected all-gather or all-to-all usually means a resharding: check the sharding rules)"
        if flagged else "")]
    return "\n".join(lines)
