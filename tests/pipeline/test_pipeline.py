"""The pipeline schedules of `jaxpar.pipeline.schedules` against the sequential model they must equal: the mean
loss over microbatches, every parameter gradient (stages and head) and the input gradients, for GPipe, circular and
1F1B, on 1, 2, 4 and 8 stages, with more microbatches than stages and fewer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from jaxpar.pipeline.one_f_one_b import one_f_one_b
from jaxpar.pipeline.schedules import circular, gpipe

LAYERS, WIDTH, ROWS = 8, 16, 4
AXIS = "stage"
RTOL, ATOL = 1e-5, 2e-6  # float32: the schedules sum the same microbatch terms in another order


def block(x, w, b):
    return x + jnp.tanh(x @ w + b)


def stage_fn(params, x, m=0):
    """A stage: its contiguous run of the stacked blocks (a leading layers dimension)."""
    return jax.lax.scan(lambda h, wb: (block(h, *wb), None), x, (params["w"], params["b"]))[0]


def loss_fn(y, target, scale=1.0):
    return jnp.mean((y * scale - target) ** 2)


HEAD = {"scale": 1.0 + 0.1 * jnp.arange(WIDTH, dtype=jnp.float32)}  # a head with its own parameters


def problem(microbatches: int):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w": 0.3 * jax.random.normal(k1, (LAYERS, WIDTH, WIDTH)), "b": 0.1 * jax.random.normal(k2, (LAYERS, WIDTH))}
    xs = jax.random.normal(k3, (microbatches, ROWS, WIDTH))
    targets = jax.random.normal(k4, (microbatches, ROWS, WIDTH))
    return params, xs, targets


def sequential(params, xs, targets, head=None):
    """The model unpipelined: every block in order on every microbatch, the mean loss."""
    scale = 1.0 if head is None else head["scale"]
    return jnp.mean(jax.vmap(lambda x, t: loss_fn(stage_fn(params, x), t, scale))(xs, targets))


def stage_mesh(stages: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:stages]), (AXIS,))


def run_1f1b(p, head, xs, ts):
    def head_fn(h, y, m):
        return loss_fn(y, ts[m], h["scale"]), {"mean_y": jnp.mean(y)}
    return one_f_one_b(stage_fn, head_fn, p, head, xs, axis=AXIS)


def pipelined_1f1b(stages: int):
    split, whole = PartitionSpec(AXIS), PartitionSpec()  # the stacked layers: a contiguous run per stage
    return jax.jit(jax.shard_map(run_1f1b, mesh=stage_mesh(stages), in_specs=(split, whole, whole, whole),
                                 out_specs=(whole, whole, split, whole, whole), check_vma=False))


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
    want_loss, (want_grads, want_input_grads, want_head) = jax.value_and_grad(
        lambda p, x, h: sequential(p, x, targets, h), argnums=(0, 1, 2))(params, xs, HEAD)
    loss, metrics, grads, head_grads, input_grads = pipelined_1f1b(stages)(params, HEAD, xs, targets)
    assert_close(loss, want_loss)
    assert_close(grads, want_grads)
    assert_close(head_grads, want_head)
    assert_close(input_grads, want_input_grads)
    want_mean_y = jnp.mean(jax.vmap(lambda x: jnp.mean(stage_fn(params, x)))(xs))
    assert_close(metrics["mean_y"], want_mean_y)


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
        jaxpr = jax.make_jaxpr(lambda p, x, t: run_1f1b(p, HEAD, x, t),
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


def pipelined_circular(stages: int, repeats: int):
    """Circular: chunk r of stage s is the (r * S + s)-th run of layers, so the stored [L] layers are laid out
    [R, S, k] and handed to the stages as [S, R, k]."""
    def loss(p, xs, ts):
        outputs = circular(lambda q, x, m, r: stage_fn(q, x), jax.tree.map(lambda a: a[0], p), xs,
                           axis=AXIS, repeats=repeats)
        mine = jnp.where(jax.lax.axis_index(AXIS) == stages - 1, jnp.mean(jax.vmap(loss_fn)(outputs, ts)), 0.0)
        return jax.lax.psum(mine, AXIS)

    mapped = jax.shard_map(loss, mesh=stage_mesh(stages), in_specs=(PartitionSpec(AXIS), PartitionSpec(),
                                                                    PartitionSpec()),
                           out_specs=PartitionSpec(), check_vma=False)

    def by_stage(params):
        k = LAYERS // (stages * repeats)
        return jax.tree.map(lambda a: a.reshape((repeats, stages, k) + a.shape[1:]).swapaxes(0, 1), params)

    def value(params, xs, ts):
        return mapped(by_stage(params), xs, ts)

    return jax.jit(jax.value_and_grad(value, argnums=(0, 1)))


@pytest.mark.parametrize("stages, repeats, microbatches", [(2, 2, 2), (2, 4, 3), (4, 2, 4), (4, 2, 6), (1, 4, 2)])
def test_circular_equals_the_sequential_model(stages, repeats, microbatches):
    params, xs, targets = problem(microbatches)
    want = jax.value_and_grad(sequential, argnums=(0, 1))(params, xs, targets)
    assert_close(pipelined_circular(stages, repeats)(params, xs, targets), want)


def test_circular_refuses_fewer_microbatches_than_stages():
    params, xs, targets = problem(2)
    with pytest.raises(ValueError, match=r"at least as many microbatches as stages \(2 < 4\)"):
        pipelined_circular(4, 2)(params, xs, targets)


def test_gpipe_keeps_each_ticks_stage_input_and_no_per_tick_copy_of_the_stage_parameters():
    """GPipe's memory: the backward keeps one stage input per tick. Picking the stage's parameters outside the
    rematerialised stage once made every tick save its own copy of them (at M = 16 on the built-in transformer,
    14.3 MB of temporaries instead of 8.0). Here a stage's parameters are 64 microbatch activations: the compiled
    temporaries may grow by a few activations per extra microbatch, never by a copy of the parameters."""
    stages, width, rows = 4, 64, 2
    params = {"w": jnp.zeros((LAYERS, width, width)), "b": jnp.zeros((LAYERS, width))}
    stage_bytes = (LAYERS // stages) * (width * width + width) * 4
    activation = rows * width * 4

    def loss(p, xs):
        return jax.lax.psum(jnp.where(jax.lax.axis_index(AXIS) == stages - 1,
                                      jnp.mean(gpipe(stage_fn, p, xs, axis=AXIS) ** 2), 0.0), AXIS)

    mapped = jax.shard_map(loss, mesh=stage_mesh(stages), in_specs=(PartitionSpec(AXIS), PartitionSpec()),
                           out_specs=PartitionSpec(), check_vma=False)
    step = jax.jit(jax.grad(mapped))

    def temporaries(count):
        xs = jnp.zeros((count, rows, width))
        return step.lower(params, xs).compile().memory_analysis().temp_size_in_bytes

    per_microbatch = (temporaries(12) - temporaries(4)) / 8
    assert stage_bytes == 64 * activation + 2 * width * 4
    assert activation <= per_microbatch <= 8 * activation, per_microbatch / activation
