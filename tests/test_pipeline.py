"""The pipeline schedules of `jaxpar.parallel.pipeline` against the sequential model they must equal: the mean
loss over microbatches, every parameter gradient and the input gradients, for GPipe and 1F1B, on 1, 2, 4 and 8
stages, with more microbatches than stages and fewer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from jaxpar.parallel.pipeline import gpipe, one_f_one_b

LAYERS, WIDTH, ROWS = 8, 16, 4
AXIS = "stage"
RTOL, ATOL = 1e-5, 2e-6  # float32: the schedules sum the same microbatch terms in another order


def block(x, w, b):
    return x + jnp.tanh(x @ w + b)


def stage_fn(params, x):
    """A stage: its contiguous run of the stacked blocks (a leading layers dimension)."""
    return jax.lax.scan(lambda h, wb: (block(h, *wb), None), x, (params["w"], params["b"]))[0]


def loss_fn(y, target):
    return jnp.mean((y - target) ** 2)


def problem(microbatches: int):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w": 0.3 * jax.random.normal(k1, (LAYERS, WIDTH, WIDTH)), "b": 0.1 * jax.random.normal(k2, (LAYERS, WIDTH))}
    xs = jax.random.normal(k3, (microbatches, ROWS, WIDTH))
    targets = jax.random.normal(k4, (microbatches, ROWS, WIDTH))
    return params, xs, targets


def sequential(params, xs, targets):
    """The model unpipelined: every block in order on every microbatch, the mean loss."""
    return jnp.mean(jax.vmap(lambda x, t: loss_fn(stage_fn(params, x), t))(xs, targets))


def stage_mesh(stages: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:stages]), (AXIS,))


def pipelined_1f1b(stages: int):
    run = lambda p, xs, ts: one_f_one_b(stage_fn, loss_fn, p, xs, ts, axis=AXIS)  # noqa: E731
    split = PartitionSpec(AXIS)  # the stacked layers: a contiguous run per stage
    return jax.jit(jax.shard_map(run, mesh=stage_mesh(stages), in_specs=(split, PartitionSpec(), PartitionSpec()),
                                 out_specs=(PartitionSpec(), split, PartitionSpec()), check_vma=False))


def pipelined_gpipe(stages: int):
    def loss(p, xs, ts):
        outputs = gpipe(stage_fn, p, xs, axis=AXIS)
        mine = jnp.where(jax.lax.axis_index(AXIS) == stages - 1, jnp.mean(jax.vmap(loss_fn)(outputs, ts)), 0.0)
        return jax.lax.psum(mine, AXIS)

    split = PartitionSpec(AXIS)
    mapped = jax.shard_map(loss, mesh=stage_mesh(stages), in_specs=(split, PartitionSpec(), PartitionSpec()),
                           out_specs=PartitionSpec(), check_vma=False)
    return jax.jit(jax.value_and_grad(mapped, argnums=(0, 1)))


def assert_close(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL), got, want)


@pytest.mark.parametrize("stages, microbatches", [(1, 3), (2, 4), (4, 8), (4, 2), (8, 5)])
def test_1f1b_equals_the_sequential_model(stages, microbatches):
    params, xs, targets = problem(microbatches)
    want_loss, (want_grads, want_input_grads) = jax.value_and_grad(sequential, argnums=(0, 1))(params, xs, targets)
    loss, grads, input_grads = pipelined_1f1b(stages)(params, xs, targets)
    assert_close(loss, want_loss)
    assert_close(grads, want_grads)
    assert_close(input_grads, want_input_grads)


@pytest.mark.parametrize("stages, microbatches", [(1, 3), (2, 4), (4, 8), (4, 2)])
def test_gpipe_equals_the_sequential_model(stages, microbatches):
    params, xs, targets = problem(microbatches)
    want = jax.value_and_grad(sequential, argnums=(0, 1))(params, xs, targets)
    assert_close(pipelined_gpipe(stages)(params, xs, targets), want)


def test_1f1b_stashes_at_most_one_input_per_stage_whatever_the_microbatch_count():
    """1F1B's bounded memory, structurally: the scan over ticks carries a stash of S stage inputs, the same for 4
    and 16 microbatches; only the input gradients it returns ([M, ...], like the inputs) grow with M."""
    def carried_shapes(microbatches):
        params, xs, targets = problem(microbatches)
        jaxpr = jax.make_jaxpr(lambda p, x, t: one_f_one_b(stage_fn, loss_fn, p, x, t, axis=AXIS),
                               axis_env=[(AXIS, 4)])(params, xs, targets)
        scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        assert len(scans) == 1
        scan = scans[0]
        carries = scan.params["num_carry"]
        consts = scan.params["num_consts"]
        return [tuple(v.aval.shape) for v in scan.invars[consts:consts + carries]]

    few, many = carried_shapes(4), carried_shapes(16)
    grown = [(a, b) for a, b in zip(few, many) if a != b]
    assert grown == [((4, ROWS, WIDTH), (16, ROWS, WIDTH))]  # the input gradients only
    assert (4, ROWS, WIDTH) in few and few.count((4, ROWS, WIDTH)) == 2  # the stash: S = 4 inputs, and dx at M = 4
