"""Why the default `Sync()`'s gradient reduction over fsdp cannot be compressed, and what can: the minimal program.

    python -m benchmarks.fsdp_hook                    # the minimal program
    python -m benchmarks.fsdp_hook --trainer          # jaxpar's steps: bytes over fsdp per codec (MLP, transformer)

One linear layer `y = x @ W` on `fsdp=8`: W [64, 32] stored split over fsdp along its rows (ZeRO-3), the batch
split over fsdp, loss `mean(y ** 2)`, the parameters all-gathered before use as `Sync()` does
(`jaxpar.strategies.sync`). Three programs:

1. `grad`: `jax.jit(jax.grad(loss))` with the gradient's sharding = W's. Its jaxpr holds no collective at all:
   `jax.grad` returns the gradient of the loss over the global batch as one global value. The partial gradient of
   a device's rows, and the reduction over fsdp that sums them, exist only after XLA's SPMD partitioner has split
   the program, below anything JAX code can touch (on XLA:CPU that reduction is a float32 all-reduce of the whole
   gradient, then each device keeps its slice: 2(F-1)/F x 4 bytes per element, twice a reduce-scatter's).
2. `grad, then int8`: the same with an int8 quantize / dequantize applied to the gradient jax.grad returned. The
   collectives over fsdp are the same ones, float32, the same bytes: the codec runs after the reduction, on the
   reduced gradient, so it compresses nothing on the wire.
3. `shard_map, int8`: manual over fsdp, the gradient of each device's rows is a value, and jaxpar's int8
   reduce-scatter (`jaxpar.parallel.fsdp_reduce`) sends int8 codes + scales: about 1/4 of the float32
   reduce-scatter's bytes.

So there is no hook between the local partial gradient and the partitioner's reduction in Auto mode; jaxpar
compresses the fsdp leg where it writes that reduction itself: `Sync(allreduce=..., compress=...)`.
"""

from __future__ import annotations

from collections import Counter

import jaxpar

ROWS, IN, OUT = 16, 64, 32
COLLECTIVE_PRIMITIVES = ("psum", "pmax", "all_gather", "all_to_all", "reduce_scatter", "psum_scatter", "ppermute",
                         "all_reduce")


def programs(mesh):
    """{name: (jaxpr text, compiled)} of the three programs on `mesh` (fsdp=8)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpar.parallel import compression, fsdp_reduce

    fsdp = "fsdp"
    w_sh, whole = NamedSharding(mesh, P(fsdp, None)), NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((ROWS, IN), jnp.float32, sharding=NamedSharding(mesh, P(fsdp, None)))
    w = jax.ShapeDtypeStruct((IN, OUT), jnp.float32, sharding=w_sh)

    def loss(w, x):
        return jnp.mean((x @ w) ** 2)

    def grad(w, x):
        w = lax.with_sharding_constraint(w, whole)  # ZeRO-3: used whole, stored split
        return jax.grad(loss)(w, x)

    def int8_roundtrip(g):
        codes, scales = compression.int8_encode(g.ravel())
        return compression.int8_decode(codes, scales, g.size).reshape(g.shape)

    def grad_then_int8(w, x):
        return int8_roundtrip(grad(w, x))

    def manual(w, x):
        def own(w, x):  # w: whole (gathered); x: this device's rows
            local = jax.grad(loss)(w, x) / lax.axis_size(fsdp)  # the partial gradient of this device's rows
            return fsdp_reduce._int8([local.reshape(lax.axis_size(fsdp), -1, OUT)], fsdp)[0]

        return jax.shard_map(own, mesh=mesh, in_specs=(P(), P(fsdp)), out_specs=P(fsdp), check_vma=False)(w, x)

    out = {}
    for name, fn in (("grad", grad), ("grad, then int8", grad_then_int8), ("shard_map, int8", manual)):
        jitted = jax.jit(fn, out_shardings=w_sh)
        out[name] = (str(jax.make_jaxpr(fn)(w, x)), jitted.lower(w, x).compile())
    return out


def fsdp_collectives(compiled, mesh) -> Counter:
    """(kind, bytes per element of its arrays, bytes the device sends) of every collective over fsdp."""
    import math

    from jaxpar.cost.hlo import bytes_sent, collective_ops

    found = Counter()
    for op in collective_ops(compiled, mesh):
        if op.axes == ("fsdp",):
            widths = tuple(sorted({nbytes // max(math.prod(dims), 1) for dims, nbytes in op.arrays}))
            found[(op.kind, widths, bytes_sent(op))] += 1
    return found


def jaxpr_collectives(jaxpr_text: str) -> list[str]:
    """The collective primitives a jaxpr calls (by name)."""
    import re

    return sorted({p for p in COLLECTIVE_PRIMITIVES if re.search(rf"\b{p}\[", jaxpr_text)})


WRITTEN = ("psum", "pmax", "all_to_all", "all_gather", "psum_scatter", "reduce_scatter")


def written_by_jaxpar(op) -> bool:
    """A collective jaxpar's code calls (its op_name ends with the primitive; a combined op names each part), not
    one the partitioner inserted (ZeRO-3's parameter all-gathers carry no primitive name)."""
    import re

    return bool(re.search(r"[/:(](" + "|".join(WRITTEN) + r")(?=$|[):])", op.op_name))


def trainer_rows(model: str, meshes, codecs):
    """Per mesh and codec: bytes the busiest device sends over exactly fsdp per step (compiled HLO): the gradient's
    reduction (every fsdp collective but the partitioner's parameter all-gathers), its codec's count, and the
    parameter all-gathers."""
    import optax

    from benchmarks import common
    from jaxpar.cost.hlo import bytes_sent, collective_ops
    from jaxpar.parallel import compression, fsdp_reduce
    from jaxpar.parallel.mesh import FSDP_AXIS

    parts = (common.setup("mlp", hidden=128, dropout=0.0, batch_size=64) if model == "mlp" else
             common.setup("transformer", dropout=0.0, batch_size=32))
    rows = []
    for spec in meshes:
        mesh = jaxpar.make_mesh(spec)
        for codec in codecs:
            trainer = common.trainer(parts, mesh, optax.adam(1e-3), strategy=jaxpar.Sync("psum", compress=codec))
            trainer.init(0)
            ops = [op for op in collective_ops(trainer.compiled_step("sync", parts.batch), mesh)
                   if op.axes == (FSDP_AXIS,)]
            gathers = sum(bytes_sent(op) for op in ops if op.kind == "all-gather" and not written_by_jaxpar(op))
            gradient = sum(bytes_sent(op) for op in ops) - gathers
            stated = (fsdp_reduce.step_wire_bytes(compression.parse_codec(codec), trainer.state_shardings.params,
                                                  trainer.abstract_state().params) if codec != "none" else None)
            rows.append(dict(model=model, mesh=spec, codec=codec, gradient=gradient, stated=stated,
                             gathers=gathers))
    return rows


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", action="store_true", help="jaxpar's steps instead of the minimal program")
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--meshes", default="data=2,fsdp=2,model=2;data=2,fsdp=4")
    args = parser.parse_args()
    mesh = jaxpar.make_mesh("fsdp=8")
    if args.trainer:
        codecs = ("none", "bf16", "fp16", "int8", "powersgd:4")
        print("| model | mesh | codec | gradient over fsdp (HLO) | codec's count | HLO / count | / uncompressed | "
              "/ float32 reduce-scatter | parameter all-gathers |")
        print("|---|---|---|---|---|---|---|---|---|")
        for model in args.models.split(","):
            rows = trainer_rows(model, args.meshes.split(";"), codecs)
            for r in rows:
                base = next(b for b in rows if b["mesh"] == r["mesh"] and b["codec"] == "none")["gradient"]
                f32 = next(b for b in rows if b["mesh"] == r["mesh"] and b["codec"] == "powersgd:4")["stated"]
                match = f"{r['gradient'] / r['stated']:.3f}" if r["stated"] else "-"
                stated = f"{r['stated']:.0f}" if r["stated"] else "-"
                print(f"| {model} | {r['mesh']} | {r['codec']} | {r['gradient']:.0f} | {stated} | {match} | "
                      f"{r['gradient'] / base:.3f} | {r['gradient'] / f32:.3f} | {r['gathers']:.0f} |", flush=True)
        return
    for name, (jaxpr, compiled) in programs(mesh).items():
        print(f"{name}: collectives in the jaxpr {jaxpr_collectives(jaxpr) or 'none'}")
        for (kind, widths, sent), count in sorted(fsdp_collectives(compiled, mesh).items()):
            print(f"  over fsdp: {count} x {kind} of {'/'.join(map(str, widths))}-byte elements, {sent:.0f} bytes "
                  "sent per device")


if __name__ == "__main__":
    main()
