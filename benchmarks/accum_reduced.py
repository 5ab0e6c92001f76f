"""Why `--grad-accum K` under the default `Sync()` still all-reduces the gradient K times per step in JAX 0.10.2:
minimal programs, then jaxpar's steps.

    python -m benchmarks.accum_reduced

Under `Sync()` the partitioner places the gradient all-reduce over data inside the backward of each microbatch
(the dot that contracts the data-split rows produces a replicated gradient), so inside the accumulation scan it runs
K times; XLA does not move a collective out of a loop. JAX's tool for deferring it keeping the math unchanged is
explicit sharding's `reduced` / `unreduced` states ("Autodiff and sharding", docs.jax.dev/en/latest/301/sharding-ad):
cast the weights to `reduced` over data, and their gradients come out `unreduced` (each replica's partial sum), to be
summed once after the scan. The programs below show where that stops in this JAX:

1. dot only, 1-axis Explicit mesh: works, the all-reduce runs once instead of K times (the page's own example);
2. the same layer with a bias (`x @ w + b`, what `nnx.Linear` does): `ShardingTypeError`, an elementwise op between a
   data-split activation and a `reduced` bias is refused;
3. jaxpar's mesh (data, stage, fsdp, model, Auto) with only data made Explicit (`jax.sharding.explicit_axes`):
   an `AssertionError` in `jax._src.core.getu` / `getr` ("Revise this after partial manual unreduced [reduced] is
   supported"): `unreduced` / `reduced` exist only when every mesh axis is Explicit (or every one Manual);
4. a convolution on `reduced` weights: `NotImplementedError` (no unreduced/reduced rule for conv_general_dilated).

The other ways keep the model's math only when the loss is a plain mean over independent examples: a per-replica
step (a `shard_map` manual over data, as `Sync('psum')` does: one all-reduce per step) or a vmap over replicas;
under them dropout masks are drawn per replica, BatchNorm uses each replica's statistics and a masked-token mean
becomes a mean of per-replica means.
"""

import jaxpar

K = 4


def _count(fn, mesh, *args):
    import jax

    from jaxpar.cost.hlo import collective_ops

    compiled = jax.jit(fn).lower(*args).compile()
    return [(op.kind, op.bytes, op.runs) for op in collective_ops(compiled, mesh)]


def _attempt(name, make):
    try:
        print(f"  {name}: {make()}")
    except Exception as error:  # the point of the program: which error this JAX raises
        import traceback

        frame = traceback.extract_tb(error.__traceback__)[-1]
        first = str(error).splitlines()[0] if str(error) else f"in {frame.name} ({frame.filename.split('/site-packages/')[-1]}:{frame.lineno})"
        print(f"  {name}: {type(error).__name__}: {first[:160]}")


def minimal():
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    xs = jax.ShapeDtypeStruct((K, 64, 16), jnp.float32, sharding=jax.NamedSharding(mesh, P(None, "data")))
    images = jax.ShapeDtypeStruct((K, 16, 8, 8, 3), jnp.float32,
                                  sharding=jax.NamedSharding(mesh, P(None, "data")))
    whole = jax.NamedSharding(mesh, P())

    def accumulate(loss, reduced: bool):
        def step(w, xs):
            if reduced:
                w = jax.tree.map(lambda a: jax.reshard(a, P(reduced={"data"})), w)
            zeros = jax.tree.map(jnp.zeros_like, w)
            if reduced:
                zeros = jax.tree.map(lambda a: jax.reshard(a, P(unreduced={"data"})), zeros)
            acc, _ = jax.lax.scan(lambda acc, x: (jax.tree.map(jnp.add, acc, jax.grad(loss)(w, x)), None), zeros, xs)
            return jax.tree.map(lambda a: jax.reshard(a, P()), acc) if reduced else acc
        return step

    dot = lambda w, x: jnp.mean((x @ w["k"]) ** 2)  # noqa: E731
    biased = lambda w, x: jnp.mean((x @ w["k"] + w["b"]) ** 2)  # noqa: E731
    conv = lambda w, x: jnp.mean(jax.lax.conv_general_dilated(  # noqa: E731
        x, w["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) ** 2)
    kernel = {"k": jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=whole)}
    with_bias = {**kernel, "b": jax.ShapeDtypeStruct((32,), jnp.float32, sharding=whole)}
    filters = {"k": jax.ShapeDtypeStruct((3, 3, 3, 4), jnp.float32, sharding=whole)}
    print(f"minimal programs on an Explicit 1-axis mesh of 8, K = {K} microbatches; collectives (kind, bytes, runs "
          f"per step)")
    with jax.set_mesh(mesh):
        _attempt("1. x @ w, replicated w     ", lambda: _count(accumulate(dot, False), mesh, kernel, xs))
        _attempt("1. x @ w, reduced w        ", lambda: _count(accumulate(dot, True), mesh, kernel, xs))
        _attempt("2. x @ w + b, reduced w, b ", lambda: _count(accumulate(biased, True), mesh, with_bias, xs))
        _attempt("4. conv, reduced filters   ", lambda: _count(accumulate(conv, True), mesh, filters, images))


def partly_explicit():
    """3: jaxpar's 4-axis Auto mesh, data alone made Explicit around the accumulation."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    mesh = jaxpar.make_mesh("8")

    def step(w, xs):
        def inner(w, xs):
            w = jax.reshard(w, P(reduced={"data"}))
            zeros = jax.reshard(jnp.zeros_like(w), P(unreduced={"data"}))
            acc, _ = jax.lax.scan(lambda acc, x: (acc + jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w), None),
                                  zeros, xs)
            return jax.reshard(acc, P())

        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return jax.sharding.explicit_axes(inner, axes="data", in_sharding=(P(), P(None, "data")))(w, xs)

    w = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=jax.NamedSharding(mesh, P()))
    xs = jax.ShapeDtypeStruct((K, 64, 16), jnp.float32, sharding=jax.NamedSharding(mesh, P(None, "data")))
    print("jaxpar's mesh `8` (data=8, stage=1, fsdp=1, model=1, Auto), data made Explicit around the accumulation")
    _attempt("3. x @ w, reduced over data", lambda: _count(step, mesh, w, xs))


def trainer_steps():
    import optax

    from benchmarks import common
    from jaxpar.cost.hlo import collective_ops

    print("jaxpar, MLP, global batch 64: all-reduces over data (bytes, runs per step)")
    for spec in ("8", "2x4"):
        mesh = jaxpar.make_mesh(spec)
        for strategy in (None, "psum"):
            for accum in (1, K):
                parts = common.setup("mlp", dropout=0.0, batch_size=64)
                trainer = jaxpar.Trainer(parts.factory, parts.loss_fn, optax.adamw(1e-3), mesh, grad_accum=accum,
                                         strategy=jaxpar.Sync(strategy))
                compiled = trainer.compiled_step("sync", trainer.shard_batch(parts.batch))
                ops = [(op.bytes, op.runs) for op in collective_ops(compiled, mesh)
                       if op.kind == "all-reduce" and "data" in op.axes]
                print(f"  `{spec}` Sync({strategy or ''}) grad_accum {accum}: {ops}")


def main():
    jaxpar.make_mesh("8")  # before anything touches JAX: provides the 8 CPU devices
    import jax

    jax.config.update("jax_traceback_filtering", "off")  # an assertion inside JAX is named by its own frame
    minimal()
    partly_explicit()
    trainer_steps()


if __name__ == "__main__":
    main()
