"""Activation memory of the pipeline schedules against the microbatch count: 1F1B stays flat, GPipe grows.

    python -m benchmarks.pipeline --stages 4 --microbatches 4,8,16

A stack of residual blocks (`--layers` blocks of width `--width`, `--rows` rows per microbatch) split over
`--stages` stages; each schedule's step (loss and every gradient) is compiled ahead of time on that many CPU
devices and XLA's memory analysis gives the temporaries per device. Nothing runs. Both schedules return the input
gradients, `[M, rows, width]` like the inputs, so 1F1B's temporaries grow by one microbatch per microbatch (that
buffer) and no more; GPipe keeps every tick's stage input for its backward. One JSON line per microbatch count.
"""

import argparse
import json

import jaxpar


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", default="4,8,16", help="comma-separated microbatch counts")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=64, help="rows per microbatch")
    args = parser.parse_args()
    jaxpar.make_mesh(str(args.stages))  # before anything touches JAX: provides the CPU devices

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    from jaxpar.pipeline.one_f_one_b import one_f_one_b
    from jaxpar.pipeline.schedules import gpipe

    def stage_fn(p, x, m=0):
        return jax.lax.scan(lambda h, wb: (h + jnp.tanh(h @ wb[0] + wb[1]), None), x, (p["w"], p["b"]))[0]

    def loss_fn(y, t):
        return jnp.mean((y - t) ** 2)

    stages, axis = args.stages, "stage"
    mesh = Mesh(np.array(jax.devices()[:stages]), (axis,))
    split, whole = PartitionSpec(axis), PartitionSpec()
    params = {"w": jnp.zeros((args.layers, args.width, args.width)), "b": jnp.zeros((args.layers, args.width))}

    def one_f_one_b_step(p, xs, ts):
        loss, _, grads, _, input_grads = one_f_one_b(stage_fn, lambda h, y, m: (loss_fn(y, ts[m]), {}), p, (), xs,
                                                     axis=axis)
        return loss, grads, input_grads

    def gpipe_loss(p, xs, ts):
        mine = jnp.mean(jax.vmap(loss_fn)(gpipe(stage_fn, p, xs, axis=axis), ts))
        return jax.lax.psum(jnp.where(jax.lax.axis_index(axis) == stages - 1, mine, 0.0), axis)

    schedules = {
        "1f1b": jax.jit(jax.shard_map(one_f_one_b_step, mesh=mesh, in_specs=(split, whole, whole),
                                      out_specs=(whole, split, whole), check_vma=False)),
        "gpipe": jax.jit(jax.value_and_grad(jax.shard_map(gpipe_loss, mesh=mesh, in_specs=(split, whole, whole),
                                                          out_specs=whole, check_vma=False), argnums=(0, 1))),
    }
    microbatch_bytes = args.rows * args.width * 4
    print(f"{stages} stages, {args.layers} blocks of width {args.width}, {args.rows} rows per microbatch "
          f"({microbatch_bytes:,} bytes); temporaries per device (XLA memory analysis):")
    for count in (int(m) for m in args.microbatches.split(",")):
        xs = jnp.zeros((count, args.rows, args.width))
        row = {"stages": stages, "microbatches": count, "microbatch_bytes": microbatch_bytes}
        for name, step in schedules.items():
            row[name] = step.lower(params, xs, xs).compile().memory_analysis().temp_size_in_bytes
        print(f"  M = {count:3d}: 1f1b {row['1f1b']:>12,}   gpipe {row['gpipe']:>12,}")
        print(json.dumps(row), flush=True)


def summarize(rows):
    """The suite's summary cell (`python -m benchmarks`) from this script's JSON rows."""
    first, last = rows[0], rows[-1]
    extra = last["microbatches"] - first["microbatches"]
    per = {name: (last[name] - first[name]) / extra / last["microbatch_bytes"] for name in ("1f1b", "gpipe")}
    return [f"temporaries per extra microbatch, in microbatches: 1F1B **{per['1f1b']:.2f}**, GPipe "
            f"**{per['gpipe']:.2f}** (S = {last['stages']}, M = {first['microbatches']}..{last['microbatches']})"]


if __name__ == "__main__":
    main()
