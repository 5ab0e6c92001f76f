"""Collectives of the non-finite guard: the minimal program that shows why a flag over gradients split over the
model axis needs one collective of its own, then jaxpar's steps with and without the guard's reduction.

    python -m benchmarks.guard_collectives

The minimal program: one linear layer `y = x @ W`, `x` split over data, `W` split over model along its outputs,
loss `mean(y ** 2)`, SGD. Its compiled step has one all-reduce over data for the gradient (dW) and none over model:
each model device computes and applies its own block of dW after the last collective that spans model (there is
none after the forward), so no other device's output can depend on that block's finiteness without a new
collective. Every formulation of the check (a global `jnp.isfinite(sum)`, `jnp.all(jnp.isfinite(...))`, a
`shard_map` psum of per-device sums) adds exactly one scalar all-reduce over model; the data axis costs nothing,
because the averaged gradient is the same on every replica.
"""

from collections import Counter

import jaxpar


def minimal(mesh):
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpar.cost.hlo import collective_ops

    w_sh, x_sh = NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("data", None))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=x_sh)
    w = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=w_sh)

    def grads(w, x):
        return jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)

    def psum_check(g):
        local = lambda b: jnp.isfinite(lax.psum(jnp.sum(b), ("data", "model")))  # noqa: E731
        return jax.shard_map(local, mesh=mesh, in_specs=P(None, "model"), out_specs=P(), check_vma=False)(g)

    checks = {"none": None, "isfinite(sum)": lambda g: jnp.isfinite(jnp.sum(g)),
              "all(isfinite)": lambda g: jnp.all(jnp.isfinite(g)), "shard_map psum": psum_check}
    for name, check in checks.items():
        def step(w, x, check=check):
            g = grads(w, x)
            new = w - 0.1 * g
            return new if check is None else jnp.where(check(g), new, w)

        compiled = jax.jit(step, out_shardings=w_sh).lower(w, x).compile()
        ops = Counter((op.kind, op.axes, op.bytes) for op in collective_ops(compiled, mesh))
        print(f"  minimal, check {name:16s} {dict(ops)}")


def trainer_steps():
    import jax.numpy as jnp
    import optax

    from benchmarks import common
    from jaxpar.cost.hlo import collective_ops
    from jaxpar.train import faults

    real = faults._all_finite
    parts = common.setup("transformer", dropout=0.0, batch_size=32)
    for spec, strategy in [("8", None), ("8", "psum"), ("4x2", "ring"), ("2x4", None), ("2x4", "ring"),
                           ("data=2,fsdp=2,model=2", None)]:
        mesh = jaxpar.make_mesh(spec)
        counts = {}
        for label, patched in [("guard", real), ("no check", lambda *a, **k: jnp.bool_(True))]:
            faults._all_finite = patched
            try:
                kw = {"strategy": jaxpar.Sync(strategy)} if strategy else {}
                trainer = common.trainer(parts, mesh, optax.adamw(1e-3), **kw)
                compiled = trainer.compiled_step("sync", trainer.shard_batch(parts.batch))
            finally:
                faults._all_finite = real
            counts[label] = Counter((op.kind, op.axes) for op in collective_ops(compiled, mesh))
        extra = counts["guard"] - counts["no check"]
        print(f"  transformer `{spec}` {strategy or 'compiler'}: {sum(counts['guard'].values())} collectives with the "
              f"guard, {sum(counts['no check'].values())} without; extra {dict(extra) or 'none'}")


def main():
    mesh = jaxpar.make_mesh("data=2,model=4")
    print("minimal program on data=2,model=4 (kind, axes, bytes): count")
    minimal(mesh)
    print("jaxpar Sync steps")
    trainer_steps()


if __name__ == "__main__":
    main()
