"""jaxpar.attention on a sequence split over the seq axis equals plain attention on one device (outputs and
gradients within 1e-5 in float32), for each algorithm, causal or not, zig-zag on or off, also inside a map manual
over data (as the explicit strategies run it); the ring's zig-zag balance; the bad-input lines."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.parallel import context as cp
from jaxpar.parallel.context import blocks, zigzag

B, L, H, K = 2, 32, 4, 8
TOL = 1e-5  # float32: the blocked / online softmax sums in another order than the plain one


def _qkv():
    return tuple(jax.random.normal(k, (B, L, H, K)) for k in jax.random.split(jax.random.key(0), 3))


def _plain(q, k, v, causal):
    pos = jnp.arange(L)
    return blocks.attend(q, k, v, pos, pos, causal, 1 / np.sqrt(K))


@pytest.mark.parametrize("algorithm, causal, zz", [
    ("allgather", True, False), ("allgather", False, False), ("ring", True, True), ("ring", True, False),
    ("ring", False, True), ("ulysses", True, False), ("ulysses", False, False)])
def test_each_algorithm_equals_plain_attention(algorithm, causal, zz):
    mesh = jaxpar.make_mesh("data=2,seq=4")
    q, k, v = _qkv()
    want = _plain(q, k, v, causal)
    want_grads = jax.grad(lambda *a: (_plain(*a, causal) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)
    with cp.running(cp.ContextParallel(algorithm, zz, mesh)) as trace:
        out = jax.jit(lambda *a: cp.attention(*a, causal=causal))(q, k, v)
        grads = jax.jit(jax.grad(lambda *a: (cp.attention(*a, causal=causal) ** 2).sum(), argnums=(0, 1, 2)))(q, k, v)
    assert trace.calls == 2
    np.testing.assert_allclose(out, want, atol=TOL)
    for got, expected in zip(grads, want_grads):
        np.testing.assert_allclose(got, expected, atol=10 * TOL)


def test_inside_a_replica_map():
    """Nested in a shard_map manual over data (the explicit strategies' replica map): still right."""
    mesh = jaxpar.make_mesh("data=2,seq=4")
    q, k, v = _qkv()
    with cp.running(cp.ContextParallel("ring", True, mesh)):
        out = jax.jit(jax.shard_map(lambda *a: cp.attention(*a), mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                    axis_names={"data"}))(q, k, v)
    np.testing.assert_allclose(out, _plain(q, k, v, True), atol=TOL)


def test_outside_a_trainer_it_is_plain_attention():
    q, k, v = _qkv()
    np.testing.assert_allclose(cp.attention(q, k, v), _plain(q, k, v, True), atol=1e-6)
    np.testing.assert_allclose(jaxpar.attention(q, k, v, causal=False), _plain(q, k, v, False), atol=1e-6)


def test_zigzag_balances_the_causal_ring():
    for ways in (2, 4, 8):
        assert zigzag.work(ways, zigzag=True) == [(ways - 1) / 2 + 1] * ways
        assert zigzag.imbalance(ways, zigzag=True) == 0.0
    # contiguous blocks: device i computes i earlier blocks and its own: 1 .. S blocks
    assert zigzag.work(4, zigzag=False) == [1.0, 2.0, 3.0, 4.0]
    assert zigzag.imbalance(8, zigzag=False) == pytest.approx(7 / 8)
    assert zigzag.work(4, causal=False) == [4.0] * 4


def test_bad_lengths_and_heads():
    with pytest.raises(jaxpar.ConfigError, match=r"--seq-len 30: .* over seq=4; use a multiple of 4, e.g. --seq-len 28"):
        cp.check_length(30, 4)
    with pytest.raises(jaxpar.ConfigError, match=r"x 2 chunks .* multiple of 8"):
        cp.check_length(36, 4, balanced=True)
    with pytest.raises(jaxpar.MeshError, match=r"only 3 positions, fewer than the 4 devices"):
        cp.check_length(3, 4, True)
    with pytest.raises(jaxpar.ConfigError, match=r"ulysses: 6 attention heads do not divide over seq=4"):
        cp.check_heads(6, 4, "ulysses")
    with pytest.raises(jaxpar.ConfigError, match=r"choose one of allgather, ring, ulysses"):
        cp.ContextParallel("tree")
    with pytest.raises(jaxpar.ModelError, match=r"\[batch, length, heads, head_dim\]"):
        jaxpar.attention(jnp.zeros((2, 4, 8)), jnp.zeros((2, 4, 8)), jnp.zeros((2, 4, 8)))
