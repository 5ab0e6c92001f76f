"""Gradient accumulation's all-reduces over data, counted in the compiled HLO (docs/data.md, gradient accumulation).

Under the default `Sync()` each microbatch's gradient is all-reduced over data inside the accumulation loop (K runs
per step); the explicit `Sync('psum')` accumulates inside each replica and all-reduces once. JAX 0.10.2 cannot defer
the compiler's reduction without changing the math (`benchmarks/accum_reduced.py`); the last test fails when a JAX
upgrade lifts the limitation that blocks it, so that the deferral can then be built.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxpar
from jaxpar.cost.hlo import collective_ops
from tests.helpers import batch_for, trainer_for

K = 4


def data_all_reduces(strategy, accum):
    trainer = trainer_for("mlp", "8", optax.adamw(1e-3), grad_accum=accum, strategy=strategy)
    compiled = trainer.compiled_step("sync", trainer.shard_batch(batch_for("mlp", 64)))
    return [(op.bytes, op.runs) for op in collective_ops(compiled, trainer.mesh)
            if op.kind == "all-reduce" and "data" in op.axes]


@pytest.mark.slow
def test_compiler_sync_all_reduces_each_microbatch_and_psum_once():
    params = (64 * 32 + 32 + 32 * 10 + 10) * 4  # the tiny MLP's gradient in float32: 9,640 bytes
    (once,) = data_all_reduces(jaxpar.Sync(), 1)
    assert once[1] == 1 and params <= once[0] <= params + 16  # the compiler adds the loss (and metrics) to it
    assert data_all_reduces(jaxpar.Sync(), K) == [(once[0], K)]  # each microbatch's gradient, in the loop
    assert data_all_reduces(jaxpar.Sync("psum"), K) == [(once[0], 1)]  # per-replica sums, one average


def test_reduced_weights_do_not_reach_a_bias_add_in_this_jax():
    """The blocker (benchmarks/accum_reduced.py, program 2): `x @ w + b` with `b` reduced over data is refused. If
    this test fails, JAX accepts it: make `Sync()`'s accumulation reduce once (docs/data.md says how)."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    x = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=jax.NamedSharding(mesh, P("data")))
    w = {"k": jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=jax.NamedSharding(mesh, P())),
         "b": jax.ShapeDtypeStruct((32,), jnp.float32, sharding=jax.NamedSharding(mesh, P()))}

    def grads(w, x):
        w = jax.tree.map(lambda a: jax.reshard(a, P(reduced={"data"})), w)
        return jax.grad(lambda w: jnp.mean((x @ w["k"] + w["b"]) ** 2))(w)

    with jax.set_mesh(mesh), pytest.raises(Exception, match="reduced"):
        jax.jit(grads).lower(w, x)
