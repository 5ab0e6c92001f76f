"""The FLOP count's rule for conditionals: a conditional counts the branch the busiest device runs (its costliest
branch, as XLA counts it), 1F1B's half-step conditional (the name scope `jaxpar.pipeline.schedules.ALTERNATING`)
the mean of its branches, and a conditional in a `taken(runs, reached)` scope (the head, the first stage's part)
its true branch `runs` of the `reached` times, loops inside the branches included.

Tolerance: the counted FLOPs lie within 10% above the matmuls' FLOPs (loop counters, tanh and selects add a little)."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpar.cost.hlo import loop_flops
from jaxpar.pipeline.schedules import ALTERNATING, taken
from jaxpar.runtime.resources import step_flops

ROWS, WIDTH, INNER = 8, 64, 3
MATMUL = 2 * ROWS * WIDTH * WIDTH


def ticks_with_a_conditional(scope, ticks: int):
    """`ticks` ticks on a 4-device axis, each a conditional between one matmul and a loop of `INNER` matmuls (the
    branch taken alternating with the tick and the device), then a ring permute."""
    mesh = jax.make_mesh((4,), ("stage",), devices=jax.devices()[:4])

    def f(w, x):
        def cheap(h):
            return jnp.tanh(h @ w)

        def dear(h):
            return lax.scan(lambda g, _: (jnp.tanh(g @ w), None), h, None, length=INNER)[0]

        def tick(h, t):
            pick = (t + lax.axis_index("stage")) % 2 == 0
            if scope:
                with jax.named_scope(scope) if isinstance(scope, str) else scope:
                    h = lax.cond(pick, cheap, dear, h)
            else:
                h = lax.cond(pick, cheap, dear, h)
            return lax.ppermute(h, "stage", [(i, (i + 1) % 4) for i in range(4)]), None

        return lax.scan(tick, x, jnp.arange(ticks))[0]

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))
    compiled = fn.lower(jnp.ones((WIDTH, WIDTH)), jnp.ones((ROWS, WIDTH))).compile()
    return loop_flops(compiled, step_flops(compiled))


def test_a_conditional_counts_its_costliest_branch_every_time():
    counted = ticks_with_a_conditional(None, 5)
    want = 5 * INNER * MATMUL  # the dear branch every tick
    assert want <= counted.per_device < 1.1 * want, counted


def test_the_alternating_conditional_counts_the_mean_of_its_branches():
    counted = ticks_with_a_conditional(ALTERNATING, 6)  # another program: the compile cache ignores name scopes
    want = 6 * (1 + INNER) / 2 * MATMUL  # half the ticks one matmul, half INNER
    assert want <= counted.per_device < 1.1 * want, counted
    assert "mean" in counted.note


def test_a_taken_conditional_counts_its_true_branch_in_its_runs_only():
    counted = ticks_with_a_conditional(taken(2, 7), 7)  # the true branch (one matmul) 2 ticks of 7, INNER in 5
    want = (2 + 5 * INNER) * MATMUL
    assert want <= counted.per_device < 1.1 * want, counted
    assert "microbatches' ticks" in counted.note


def test_a_taken_conditional_inside_a_half_step_branch_counts_in_that_branch_only():
    """The 1F1B shape: the forward branch holds the head's conditional (dear in 3 of the 5 forward half-steps), the
    backward branch one matmul."""
    mesh = jax.make_mesh((4,), ("stage",), devices=jax.devices()[:4])

    def f(w, x):
        def dear(h):
            return lax.scan(lambda g, _: (jnp.tanh(g @ w), None), h, None, length=INNER)[0]

        def forward(h):
            with taken(3, 5):
                return lax.cond(lax.axis_index("stage") == 3, dear, lambda g: g, h)

        def tick(h, t):
            with jax.named_scope(ALTERNATING):
                h = lax.cond((t + lax.axis_index("stage")) % 2 == 0, forward, lambda g: jnp.tanh(g @ w), h)
            return lax.ppermute(h, "stage", [(i, (i + 1) % 4) for i in range(4)]), None

        return lax.scan(tick, x, jnp.arange(10))[0]

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))
    compiled = fn.lower(jnp.ones((WIDTH, WIDTH)), jnp.ones((ROWS, WIDTH))).compile()
    counted = loop_flops(compiled, step_flops(compiled))
    want = (5 * 3 / 5 * INNER + 5 * 1) * MATMUL  # 5 forward half-steps (3 of them dear), 5 backward (one matmul)
    assert want <= counted.per_device < 1.1 * want, counted
