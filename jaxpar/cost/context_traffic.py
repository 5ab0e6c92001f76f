"""`explain` for context parallelism (a mesh with seq > 1): the collectives over the seq axis read from the compiled
step, against theory.

Theory per device and step, with b = one device's block of K (or V, or q): rows / (data x fsdp) x L / S x heads /
model x head_dim x its bytes, and E = attention runs per step (the layers of the model's Stacks, or each call of an
unstacked model, x grad_accum, which leaves b x E unchanged):
- allgather: K and V all-gathered forward ((S-1) b each), their gradients reduce-scattered backward: 4 (S-1) b E;
- ring: K and V ppermuted S-1 times forward and their gradients S-1 times backward: 4 (S-1) b E; zig-zag adds q, k
  and v re-laid (two half-block permutes each) and the output laid back, forward and backward: + 8 b E (a chunk
  whose home is its own device is a permute to itself, counted as the compiled program holds it);
- ulysses: q, k, v and the output all-to-all'd forward, their gradients backward: 8 (S-1)/S b E.
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
        extra = 8 * block * runs if zigzag else 0.0
        return 4 * (s - 1) * block * runs + extra, "4 (S-1) b E (K, V permuted S-1 times each way)" + (
            " + 8 b E (zig-zag re-layout of q, k, v and the output, both passes)" if zigzag else "")
    return 8 * (s - 1) / s * block * runs, "8 (S-1)/S b E (q, k, v and the output all-to-all'd, both passes)"


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

