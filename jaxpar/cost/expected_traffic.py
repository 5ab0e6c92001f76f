"""What theory says a trainer's step should send: per mesh axis, the strategy's exchanges over the replica axis
(its algorithm's textbook traffic, compressed by its codec), ZeRO-3 over fsdp and tensor parallelism over model; and
whether theory explains a collective the compiled step holds (`expected`: `--explain` flags the rest)."""
from __future__ import annotations

import jax

from jaxpar.cost import codecs, pipelines, strategy_costs, topology
from jaxpar.cost.sharding_layout import fsdp_group_bytes, gradient_bytes
from jaxpar.cost.step_pricer import profile_of
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.collectives import theoretical_traffic

DATA, STAGE, FSDP, MODEL = mesh_lib.DATA, mesh_lib.STAGE, mesh_lib.FSDP, mesh_lib.MODEL

_ALGORITHM_LABELS = {"psum": "bandwidth-optimal all-reduce, 2(N-1)/N x B", "ring": "ring, 2(N-1)/N x B",
                     "torus2d": "2D torus, 2(N-1)/N x B",
                     "ps": "parameter server: the root receives and sends (N-1) x B"}


def theory(trainer, variant: str, blocks: int | None = None, batch=None) -> list[dict]:
    """What the strategy and mesh should send per device in one step of `variant`, line by line: the strategy's
    exchanges over the replica axis (`strategy_costs.theory`), ZeRO-3 over fsdp (its gradient third the codec's fsdp leg
    where one applies to global batches shaped like `batch`: `codecs.fsdp_leg`), tensor parallelism over model."""
    mesh, strategy = trainer.mesh, trainer.strategy
    n = mesh_lib.replica_count(mesh)
    communicator = trainer.ctx.communicator
    algorithm = communicator.name if communicator is not None else "psum"
    torus_x = getattr(communicator, "torus_x", None)
    lines = []
    for expected in (strategy_costs.theory(strategy, variant, gradient_bytes(trainer)) if n > 1 else []):
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
        pf = fsdp_group_bytes(trainer)
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


def expected(op, variant: str, trainer) -> bool:
    """Whether theory explains a collective: an unexpected one (e.g. an all-gather over data) is flagged."""
    axes = set(op.axes or ())
    communicator = trainer.ctx.communicator
    explicit = communicator is not None and not communicator.native
    local = not strategy_costs.theory(trainer.strategy, variant, 0)  # a variant that exchanges nothing over data
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
    if mesh_lib.SEQ in axes:  # jaxpar.attention's K/V gathers, ring permutes, all-to-alls, and gradient sums over seq
        return True
    return False
