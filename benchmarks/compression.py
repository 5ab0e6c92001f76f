"""Gradient compression: the bytes each codec puts on the data axis, read from the compiled train step, against the
codec's own count (`CompressedCommunicator.wire_bytes`) and against the uncompressed float32 exchange. No training.

    python -m benchmarks.compression                       # the digits MLP (hidden 128) on 8 and 2x4, psum and ring
    python -m benchmarks.compression --model transformer   # the default transformer
    python -m benchmarks.compression --strategy local_sgd  # a local SGD meeting (its outer gradient compressed)

"sent" is the bytes the busiest device sends over `data` per step (`jaxpar.cost.hlo.bytes_sent` of every
collective whose groups span exactly the data axis: the codec's exchange plus the loss / accuracy pmean, 8
bytes; a local SGD meeting's metrics stay per replica, so a meeting sends the codec's exchange alone). "stated" is
the codec's count for this device's gradient shapes (its shard for the elementwise codecs, which run per device;
the whole arrays for PowerSGD). "ratio" is sent / the uncompressed explicit step's sent.
"""

from __future__ import annotations

import argparse
import json

import jax

import jaxpar
from benchmarks import common
from jaxpar.cost import codecs

CODECS = ("none", "bf16", "fp16", "int8", "powersgd:4")


STRATEGIES = {"sync": ("Sync", "sync"), "local_sgd": ("LocalSGD", "meet")}  # -> (class, the step variant measured)


def sent_over_data(trainer, batch, variant="sync") -> float:
    """Bytes the busiest device sends per step in the collectives over exactly the replica axis (a permute counted
    for its sources only, `explain.busiest_sent`: a parameter server's root sends more than its workers)."""
    from jaxpar.cost.explain import busiest_sent
    from jaxpar.cost.hlo import collective_ops
    from jaxpar.parallel.mesh import REPLICA_AXIS

    ops = collective_ops(trainer.compiled_step(variant, batch), trainer.mesh)
    return busiest_sent([op for op in ops if op.axes == (REPLICA_AXIS,)], trainer.mesh.size).get(REPLICA_AXIS, 0.0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=["mlp", "transformer"])
    parser.add_argument("--meshes", default="8;2x4", help="mesh specs separated by ';'")
    parser.add_argument("--allreduce", default="psum,ring", help="algorithms separated by ','")
    parser.add_argument("--flops", action="store_true",
                        help="instead: the compiled step's FLOPs per device with each codec minus without, per "
                             "gradient element, against the codec's own count (psum; meshes 2 and 8)")
    parser.add_argument("--strategy", default="sync", choices=list(STRATEGIES),
                        help="sync: the gradient exchange of a step; local_sgd: a meeting's (DiLoCo sends the same)")
    args = parser.parse_args()
    if args.flops:
        return flops_table(args.model)
    jaxpar.make_mesh("8")  # before anything touches JAX: provides the CPU devices
    import optax

    if args.model == "mlp":
        parts = common.setup("mlp", hidden=128, dropout=0.0, batch_size=64)
    else:
        parts = common.setup("transformer", dropout=0.0, batch_size=32)
    rows = []
    cls, variant = STRATEGIES[args.strategy]
    cls = getattr(jaxpar, cls)
    for spec in args.meshes.split(";"):
        mesh = jaxpar.make_mesh(spec)
        for algorithm in args.allreduce.split(","):
            base = None
            for codec in CODECS:
                strategy = cls(allreduce=algorithm, compress=codec)
                trainer = common.trainer(parts, mesh, optax.adam(1e-3), strategy=strategy)
                trainer.init(0)
                sent = sent_over_data(trainer, parts.batch, variant)
                base = sent if codec == "none" else base
                comm = trainer.strategy.communicator
                stated = None
                if codec != "none":
                    stated = comm.wire_bytes(codecs.gradient_shapes(trainer), trainer.num_replicas,
                                             codecs.gradient_splits(trainer))
                row = {"model": args.model, "strategy": args.strategy, "mesh": spec, "allreduce": algorithm,
                       "codec": codec, "sent": sent, "stated": stated, "ratio": sent / base if base else None}
                rows.append(row)
                print(json.dumps(row), flush=True)
    what = "per step" if variant == "sync" else "per meeting"
    print(f"\n{args.model}, {args.strategy}: bytes sent per device over data {what}, compiled HLO vs the codec's "
          f"count\n")
    print("| mesh | allreduce | codec | sent (HLO) | stated | sent / stated | sent / uncompressed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        stated = f"{r['stated']:.0f}" if r["stated"] is not None else "-"
        match = f"{r['sent'] / r['stated']:.3f}" if r["stated"] else "-"
        print(f"| {r['mesh']} | {r['allreduce']} | {r['codec']} | {r['sent']:.0f} | {stated} | {match} | "
              f"{r['ratio']:.3f} |")


def flops_table(model: str):
    """XLA's FLOPs of the codec (the compiled step's with it minus without) against `codec.flops`, per element."""
    import math

    import optax

    from jaxpar.cost.hlo import loop_flops
    from jaxpar.runtime.resources import step_flops

    jaxpar.make_mesh("8")
    parts = (common.setup("mlp", hidden=128, dropout=0.0, batch_size=64) if model == "mlp" else
             common.setup("transformer", dropout=0.0, layers=1, d_model=64, heads=4, d_ff=256, seq_len=64,
                          batch_size=32))
    print(f"\n{model}: FLOPs per device per step, XLA's count of the compiled step with the codec minus without "
          f"(psum), and the codec's own count (`codec.flops`), per gradient element\n")
    print("| replicas | codec | XLA delta | XLA per element | codec's count per element (without the QR) |")
    print("|---|---|---|---|---|")
    for n in (2, 8):
        mesh = jaxpar.make_mesh(str(n), devices=jax.devices()[:n])
        base = None
        for codec in CODECS:
            trainer = common.trainer(parts, mesh, optax.adam(1e-3), strategy=jaxpar.Sync("psum", compress=codec))
            compiled = trainer.compiled_step("sync", parts.batch)
            count = loop_flops(compiled, step_flops(compiled)).per_device
            shapes = [x.shape for x in jax.tree.leaves(trainer.abstract_state().params)]
            elements = sum(math.prod(s) for s in shapes)
            if codec == "none":
                base = count
                continue
            own = trainer.strategy.communicator.codec.flops(shapes, n)
            stated = sum(v for k, v in own.items() if k != "orthogonalise")
            print(f"| {n} | {codec} | {count - base:,.0f} | {(count - base) / elements:.2f} | "
                  f"{stated / elements:.2f} |", flush=True)


def summarize(rows: list[dict]) -> list[str]:
    worst = max((abs(r["sent"] / r["stated"] - 1) for r in rows if r["stated"]), default=0.0)
    return [f"{len(rows)} compiled steps; HLO bytes within {100 * worst:.1f}% of the codecs' counts"]


if __name__ == "__main__":
    main()
