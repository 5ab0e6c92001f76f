"""int8 as a two-shot quantized all-reduce (`jaxpar.parallel.compression.int8`): the error-feedback identities at
both quantizations, the mean against the float32 mean within the quantization bound, the long-run sum with error
feedback against the exact one, on every algorithm."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxpar
from jaxpar.parallel import compression as cz
from jaxpar.parallel.mesh import REPLICA_AXIS
from jaxpar.parallel.partitioning import PER_REPLICA

N, SIZE = 8, 2400  # 8 shards of 300 elements, each 2 chunks (256 + 44); under ps one shard of 10 chunks


def per_replica(fn):
    mesh = jaxpar.make_mesh("8")
    wrapped = jax.shard_map(lambda *a: jax.tree.map(lambda x: x[None], fn(*jax.tree.map(lambda x: x[0], a))),
                            mesh=mesh, in_specs=PER_REPLICA, out_specs=PER_REPLICA, check_vma=False)
    return jax.jit(wrapped)


def two_shot(algorithm, codec=None):
    codec = codec or cz.Int8()

    def one(x, owner, sender):
        (mean,), own, _ = codec.mean([x], [owner, sender] if codec.error_feedback else [], (),
                                     cz.Exchange(REPLICA_AXIS, algorithm, None), N, REPLICA_AXIS)
        return (mean, *own) if own else (mean,)

    return per_replica(one)


def owner_of(algorithm):
    """The replica owning each element: its shard of 300; under ps, device 0 owns all."""
    return np.zeros(SIZE, int) if algorithm == "ps" else np.arange(SIZE) // (SIZE // N)


def shard_length(algorithm):
    return SIZE if algorithm == "ps" else SIZE // N


def chunk_scales(v, length):
    """Per element, its chunk's scale: chunks of 256 from the start of each shard of `length`."""
    out = np.empty_like(v)
    for start in range(0, v.size, length):
        for a in range(start, start + length, cz.INT8_CHUNK):
            b = min(a + cz.INT8_CHUNK, start + length)
            out[a:b] = np.float32(np.abs(v[a:b]).max()) / np.float32(127)
    return out


def decoded(v, length):
    """int8 codes and back, by numpy: round(v / scale), clipped to +-127, times the scale."""
    scales = chunk_scales(v, length)
    return np.clip(np.round(v / scales), -127, 127) * scales


@pytest.mark.parametrize("algorithm", ["psum", "ring", "torus2d", "ps"])
def test_both_residuals_keep_what_each_quantization_dropped(algorithm):
    rng = np.random.default_rng(2)
    g = rng.normal(size=(N, SIZE)).astype(np.float32)
    old_sender = (0.01 * rng.normal(size=(N, SIZE))).astype(np.float32)
    old_owner = (0.01 * rng.normal(size=(N, SIZE))).astype(np.float32)
    mean, new_owner, new_sender = (np.asarray(a) for a in two_shot(algorithm)(g, old_owner, old_sender))
    sent = np.stack([decoded(v, shard_length(algorithm)) for v in g + old_sender])
    # the sender: what it sent plus its new residual is its gradient plus its old residual
    np.testing.assert_allclose(sent + new_sender, g + old_sender, rtol=0, atol=1e-6)
    # the owner: the mean every replica receives plus the owner's new residual is the mean of what was sent plus
    # the owner's old residual, element by element; each replica's owner residual is zero outside its shard
    owner = owner_of(algorithm)
    held = old_owner[owner, np.arange(SIZE)]
    np.testing.assert_allclose(mean[0] + new_owner.sum(0), sent.mean(0) + held, rtol=0, atol=1e-5)
    assert (new_owner[owner != np.arange(N)[:, None]] == 0).all()
    assert (mean == mean[0]).all()  # every replica decodes the same codes


@pytest.mark.parametrize("algorithm", ["psum", "ring"])
def test_the_two_shot_mean_is_the_float32_mean_within_both_quantization_steps(algorithm):
    g = np.random.default_rng(3).normal(size=(N, SIZE)).astype(np.float32)
    zeros = np.zeros_like(g)
    (mean,) = (np.asarray(a) for a in two_shot(algorithm, cz.Int8(error_feedback=False))(g, zeros, zeros))
    exact = g.mean(0)
    # per element: half a step of each sender's chunk, averaged, plus half a step of the requantized mean's chunk
    sender_half = np.stack([chunk_scales(v, SIZE // N) for v in g]).mean(0) / 2
    owner_half = chunk_scales(exact, SIZE // N) / 2
    error = np.abs(mean[0] - exact)
    assert (error <= (sender_half + owner_half) * 1.01 + 1e-7).all()
    assert error.max() > 0  # it is lossy: 8 normal gradients of 256-element chunks, steps of about 0.02


def test_error_feedback_keeps_the_long_run_sum_within_one_step_of_the_exact_sum():
    """Over 40 exchanges, the sum of the means with error feedback differs from the exact sum by what the last
    residuals hold (the telescoping sum): at most half a sender step (averaged) plus half an owner step per element,
    however many exchanges. Without error feedback the dropped errors accumulate."""
    rng = np.random.default_rng(4)
    ef, noef = two_shot("ring"), two_shot("ring", cz.Int8(error_feedback=False))
    owner = sender = np.zeros((N, SIZE), np.float32)
    total_ef, total_noef, exact = (np.zeros(SIZE, np.float64) for _ in range(3))
    for _ in range(40):
        g = (rng.normal(size=(N, SIZE)) * 0.1 + 0.01).astype(np.float32)
        mean, owner, sender = (np.asarray(a) for a in ef(g, owner, sender))
        total_ef += mean[0]
        total_noef += np.asarray(noef(g, owner, sender)[0])[0]
        exact += g.astype(np.float64).mean(0)
    gap = np.abs(total_ef - exact)
    np.testing.assert_allclose(total_ef, exact - sender.mean(0) - owner.sum(0), rtol=0, atol=1e-4)
    assert gap.max() <= 0.01, gap.max()  # steps of about 0.4/127 = 0.003: half a sender + half an owner step
    assert np.abs(total_noef - exact).max() > 3 * gap.max()
