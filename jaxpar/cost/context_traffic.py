"""`explain` for context parallelism (a mesh with seq > 1): the collectives over the seq axis read from the compiled
step, against theory.

Theory per device and step, with b = one device's block of K (or V, or q): rows / (data x fsdp) x L / S x heads /
model x head_dim x its bytes, and E = attention runs per step (the layers of the model's Stacks, or each call of an
unstacked model, x grad_accum, which leaves b x E unchanged):
- allgather: K and V all-gathered forward ((S-1) b each), their gradients reduce-scattered backward: 4 (S-1) b E;
- ring: K and V ppermuted S-1 times forward and their gradients S-1 times backward: 4 (S-1) b E; zig-zag adds q, k
  and v re-laid (two half-block permutes each) and the output laid back, forward and backward: + 8 b E (a chunk
  whose home is its own device is a permute to itself, counted as the compiled program holds it; on seq=2 each
  device keeps its first chunk, so nothing is sent for it: + 4 b E);
- ulysses: q, k, v and the output all-to-all'd forward, their gradients backward: 8 (S-1)/S b E.
With a stage axis (`pipelined`; b is then a microbatch's block, as the stack's layers see it) a device runs its
stage's E / (P R) layers per tick, on every tick, the bubble's included, and the backward recomputes each tick's
forward (its traffic once more: 1.5x). GPipe and circular: 1.5 x T x E / (P R) x (R M + P - 1) ticks. 1F1B on a
seq mesh runs a forward and a backward in each of its 2 (M + P - 1) half-steps (`jaxpar.pipeline.schedules.branch`):
1.5 x T x E / P x 2 (M + P - 1). T is the line above for one layer. The part before the stack and the head run
inside 1F1B's half-steps too, so the sequence shift of their tokens adds to 1F1B's measured bytes.
The model's attention shapes are read by tracing the loss abstractly with `jaxpar.attention` recording its inputs.
"""
from __future__ import annotations

import jax
import numpy as np

from jaxpar.cost.hlo import bytes_sent
from jaxpar.cost.sharding_layout import gradient_bytes
from jaxpar.parallel import context as cp
from jaxpar.parallel import mesh as mesh_lib

SEQ = mesh_lib.SEQ_AXIS


def attention_shapes(trainer, batch) -> list:
    """(q's global shape, dtype) of each `jaxpar.attention` call the loss makes on `batch`, traced abstractly."""
    from flax import nnx

    from jaxpar.train.step import call_loss, make_rngs

    state, ctx, shapes = trainer.abstract_state(neutral=True), trainer.ctx, []

    def loss(params, model_state, batch):
        with cp.running(trainer.context_parallel) as trace:
            out = call_loss(ctx.loss_fn, nnx.merge(ctx.graphdef, params, model_state), batch,
                            make_rngs(jax.random.key(0)))
        shapes.extend(trace.shapes)
        return out

    strip = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
    jax.eval_shape(loss, strip(state.params), strip(state.model_state), strip(batch))
    return shapes


def runs_per_call(trainer) -> int:
    from jaxpar.pipeline.stack import stacks

    from flax import nnx

    found = stacks(nnx.merge(trainer.ctx.graphdef, trainer.abstract_state(neutral=True).params))
    return sum(s.num_layers for s in found) // len(found) if found else 1


def theory(algorithm: str, ways: int, block: float, runs: float, zigzag: bool) -> tuple[float, str]:
    s = ways
    if algorithm == cp.ALLGATHER:
        return 4 * (s - 1) * block * runs, "4 (S-1) b E (K, V all-gathered forward, reduce-scattered backward)"
    if algorithm == cp.RING:
        relaid = 4 if s == 2 else 8  # on seq=2 every device keeps its own first chunk: half the re-layout moves
        extra = relaid * block * runs if zigzag else 0.0
        return 4 * (s - 1) * block * runs + extra, "4 (S-1) b E (K, V permuted S-1 times each way)" + (
            f" + {relaid} b E (zig-zag re-layout of q, k, v and the output, both passes)" if zigzag else "")
    return 8 * (s - 1) / s * block * runs, "8 (S-1)/S b E (q, k, v and the output all-to-all'd, both passes)"


def pipelined(pipeline, stages: int, per_layer: float, layers: int, what: str) -> tuple[float, str]:
    """The seq traffic of one device of a `stages`-stage pipeline of `layers` layers, from `per_layer` (the line's
    theory for one layer on a microbatch's block)."""
    from jaxpar.pipeline.config import ONE_F_ONE_B

    m, r = pipeline.microbatches, pipeline.rounds
    if pipeline.schedule == ONE_F_ONE_B:
        steps, how, per_tick = 2 * (m + stages - 1), f"2 (M + P - 1) = {2 * (m + stages - 1)} half-steps", "E / P"
        runs = layers / stages
    else:
        steps, how, per_tick = pipeline.ticks(stages), f"R M + P - 1 = {pipeline.ticks(stages)} ticks", "E / (P R)"
        runs = layers / (stages * r)
    return 1.5 * per_layer * runs * steps, (f"[{what}] / E per layer on a microbatch's block b, x 1.5 (each tick's "
                                            f"forward recomputed), x {per_tick} layers a tick, x {how}")


def report(trainer, batch, ops) -> dict | None:
    """The seq section of one compiled variant's `explain` entry (None without a seq axis)."""
    mesh, settings = trainer.mesh, trainer.context_parallel
    ways = mesh_lib.seq_ways(mesh)
    if ways == 1:
        return None
    over = [op for op in ops if op.axes == (SEQ,)]
    by_kind: dict = {}
    for op in over:  # the all-reduces over seq alone are the gradients' sum (and metric means), not attention
        if op.kind != "all-reduce":
            by_kind[op.kind] = by_kind.get(op.kind, 0.0) + bytes_sent(op)
    summed = sum(bytes_sent(op) for op in over if op.kind == "all-reduce")
    out = {"algorithm": settings.algorithm, "ways": ways, "zigzag": settings.balanced, "bytes": sum(by_kind.values()),
           "by_kind": by_kind, "theory": None, "gradient_sum": summed,
           "gradient_sum_theory": 2 * (ways - 1) / ways * gradient_bytes(trainer)}
    try:
        shapes = attention_shapes(trainer, batch)
    except Exception as error:  # noqa: BLE001 - a model explain cannot trace abstractly: no theory, said so
        out["note"] = f"the model's attention could not be traced abstractly ({type(error).__name__})"
        return out
    if not shapes:
        out["note"] = "the model never calls jaxpar.attention"
        return out
    (rows, length, heads, head_dim), dtype = shapes[0]
    split_heads = heads / mesh_lib.size(mesh, mesh_lib.TENSOR_AXIS)
    block = rows / mesh_lib.batch_ways(mesh) * length / ways * split_heads * head_dim * np.dtype(dtype).itemsize
    runs = len(shapes) * runs_per_call(trainer)
    out["theory"], out["what"] = theory(settings.algorithm, ways, block, runs, settings.balanced)
    stages = mesh_lib.size(mesh, mesh_lib.STAGE_AXIS)
    if stages > 1 and runs_per_call(trainer) > 1:
        out["theory"], out["what"] = pipelined(trainer.pipeline, stages, out["theory"] / runs, runs, out["what"])
    out.update(block_bytes=block, runs=runs, shape=[rows, length, heads, head_dim])
    return out


def lines(c: dict) -> list[str]:
    kinds = ", ".join(f"{kind} {sent:,.0f}" for kind, sent in sorted(c["by_kind"].items()))
    out = [f"  context parallel {c['algorithm']} over seq={c['ways']}{' (zig-zag)' if c['zigzag'] else ''}: "
           f"attention sends over seq per device per step {c['bytes']:,.0f} bytes ({kinds or 'nothing'})"]
    if c["theory"]:
        out.append(f"    theory {c['what']} = {c['theory']:,.0f} (b = {c['block_bytes']:,.0f} bytes: q/k/v "
                   f"{tuple(c['shape'])} per device block, E = {c['runs']:g}); measured / theory "
                   f"{c['bytes'] / c['theory']:.3f}")
    else:
        out.append(f"    no theory: {c.get('note', '')}")
    out.append(f"    gradients summed over seq (all-reduces over seq alone): {c['gradient_sum']:,.0f} bytes; theory "
               f"2 (S-1)/S x G = {c['gradient_sum_theory']:,.0f} (G: the gradient's bytes per device)")
    return out

