"""Gradient compression at local SGD / DiLoCo meetings: what a meeting sends is each replica's outer gradient
(anchor - replica parameters), encoded by the codec; the mean parameters are anchor - the decoded mean. `none` is
today's meeting bit for bit; bf16 and PowerSGD at full rank against the uncompressed meeting; int8's error
feedback over two meetings against numpy; post-local SGD's warm-up left uncompressed; the skip guard, non-finite
values, restores and the compiled wire bytes; the command line's lines."""

import functools

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp

import jaxpar
import run
from jaxpar.cost.hlo import bytes_sent, collective_ops
from jaxpar.parallel import compression as cz
from jaxpar.parallel.mesh import REPLICA_AXIS
from jaxpar.train.faults import ReplicaCheck
from tests.helpers import batch_for, trainer_for

N = 8


def leaves(tree) -> list[np.ndarray]:
    """Every leaf as numpy (typed PRNG keys as their key data)."""
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(tree)]


def residuals(state) -> list[np.ndarray]:
    return leaves(state.comm_state[cz.OWN])


def brought_to_the_meeting(trainer, state, batch) -> list[np.ndarray]:
    """Each replica's parameters as it brings them to the meeting `state` is about to hold: the meeting step's own
    update, run as a local step (step number 0 plans one at period 2) on a copy (same key, same batch)."""
    copy = jax.tree.map(jnp.copy, state)
    local, _ = trainer.step(copy, batch, 0)
    return leaves(local.strategy_state["params"])


def run_steps(trainer, steps, same_batch=False, size=16):
    state, losses = trainer.init(0), []
    for i in range(steps):
        state, metrics = trainer.step(state, batch_for("mlp", size, seed=0 if same_batch else i), i)
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.slow
@pytest.mark.parametrize("cls,local_after", [(jaxpar.LocalSGD, 0), (jaxpar.LocalSGD, 1), (jaxpar.DiLoCo, 0)])
def test_compress_none_is_todays_meeting_bit_for_bit(cls, local_after):
    a, la = run_steps(trainer_for("mlp", "8", strategy=cls(period=2, local_after=local_after, compress="none")), 5)
    b, lb = run_steps(trainer_for("mlp", "8", strategy=cls(period=2, local_after=local_after)), 5)
    assert la == lb
    for x, y in zip(leaves((a.params, a.opt_state, a.strategy_state)), leaves((b.params, b.opt_state,
                                                                             b.strategy_state))):
        np.testing.assert_array_equal(x, y)
    assert a.comm_state == () == b.comm_state


@pytest.mark.slow
def test_a_bf16_meeting_is_the_mean_within_bfloat16_rounding_of_the_outer_gradient():
    """Each outer gradient is rounded to bfloat16 (unit roundoff 2^-8), summed in float32 and the sum rounded once
    more: |bf16 mean - float32 mean| <= 2^-7 x max over replicas of |outer gradient|, plus float32's rounding of
    anchor - mean."""
    plain = trainer_for("mlp", "8", strategy=jaxpar.LocalSGD(period=2))
    packed = trainer_for("mlp", "8", strategy=jaxpar.LocalSGD(period=2, compress="bf16"))
    first, second = batch_for("mlp", 16, seed=0), batch_for("mlp", 16, seed=1)
    a, _ = plain.step(plain.init(0), first, 0)
    b, _ = packed.step(packed.init(0), first, 0)
    anchor, brought = leaves(a.params), brought_to_the_meeting(plain, a, second)
    a, _ = plain.step(a, second, 1)
    b, _ = packed.step(b, second, 1)
    for x, got, want, theta in zip(anchor, leaves(b.params), leaves(a.params), brought):
        delta = x - theta  # [R, ...]: each replica's outer gradient
        bound = 2.0 ** -7 * np.abs(delta).max(0) + 2.0 ** -21 * np.abs(want)  # (+ 4 float32 ulps)
        assert (np.abs(got - want) <= bound).all(), np.max(np.abs(got - want) - bound)
        assert np.abs(got - want).max() > 0  # lossy: not the float32 mean
    for r in range(N):  # every replica restarts from the (same) decoded mean
        for got, theta in zip(leaves(b.params), leaves(b.strategy_state["params"])):
            np.testing.assert_array_equal(theta[r], got)


@pytest.mark.slow
def test_int8_error_feedback_over_two_meetings_matches_numpy():
    """At each meeting replica i sends v_i = (anchor - theta_i) + its old sender residual s_i; the shard owners
    requantize the mean with their owner residuals o_j. Nothing is lost: the anchor moves by exactly
    mean_i (v_i - s_i') + sum_j (o_j - o_j') (s', o': the new residuals), and each new residual is at most half a
    quantization step (of a chunk whose absmax is at most the largest |v|, resp. the largest requantized mean)."""
    trainer = trainer_for("mlp", "8", strategy=jaxpar.LocalSGD(period=2, compress="int8"))
    state = trainer.init(0)
    split = lambda st: (leaves(st.comm_state[cz.OWN]["owner"]), leaves(st.comm_state[cz.OWN]["sender"]))  # noqa
    old_owner, old_sender = split(state)
    assert all((r == 0).all() for r in old_owner + old_sender)
    for meeting in (1, 3):
        state, _ = trainer.step(state, batch_for("mlp", 16, seed=meeting - 1), meeting - 1)
        old_owner, old_sender = split(state)
        batch = batch_for("mlp", 16, seed=meeting)
        anchor, brought = leaves(state.params), brought_to_the_meeting(trainer, state, batch)
        state, _ = trainer.step(state, batch, meeting)
        new_owner, new_sender = split(state)
        largest_v = largest_moved = 0.0
        for x, theta, o0, s0, o1, s1, got in zip(anchor, brought, old_owner, old_sender, new_owner, new_sender,
                                                  leaves(state.params)):
            v = (x - theta) + s0
            moved = (v - s1).mean(0) + o0.sum(0) - o1.sum(0)
            np.testing.assert_allclose(x - got, moved, rtol=0, atol=2e-6)
            largest_v, largest_moved = max(largest_v, np.abs(v).max()), max(largest_moved, np.abs(moved).max())
        # a chunk may span leaves of one group: the bound is the largest value of any leaf
        assert max(np.abs(r).max() for r in new_sender) <= largest_v / 254 * 1.001
        assert max(np.abs(r).max() for r in new_owner) <= (largest_moved + largest_v / 127) / 254 * 1.01
        assert any(np.abs(r).max() > 0 for r in new_sender) and any(np.abs(r).max() > 0 for r in new_owner)


class FullRankPowerSGD(cz.PowerSGD):
    """PowerSGD on every matrix, whatever its size (the rule (n + m) R < n m never holds at full rank)."""

    def compresses(self, shape) -> bool:
        return len(shape) >= 2


@pytest.mark.slow
def test_powersgd_at_full_rank_meets_like_the_uncompressed_meeting():
    """Rank 32 >= min(n, m) of both MLP kernels (64 x 32, 32 x 10) from a random (full-rank) Q: P Q^T is the mean
    outer gradient, so the first meeting ends where the uncompressed one does, to float32 rounding of the QR and the
    matmuls (measured 3e-8; outer gradients ~1e-2). The second starts from the warm-start Q = M^T P of the first,
    whose rank is the first outer gradient's: here 27, five hidden units had no gradient yet. What that round cannot
    send stays in the residuals: new anchor + mean old residual - mean new residual = the uncompressed anchor."""
    codec = FullRankPowerSGD(32)
    plain = trainer_for("mlp", "8", strategy=jaxpar.LocalSGD(period=2))
    packed = trainer_for("mlp", "8", strategy=jaxpar.LocalSGD(period=2, compress=codec))
    a, b = plain.init(0), packed.init(0)
    for step in range(4):
        batch = batch_for("mlp", 64, seed=step)
        old = residuals(b)
        a, ma = plain.step(a, batch, step)
        b, mb = packed.step(b, batch, step)
        assert float(mb["loss"]) == pytest.approx(float(ma["loss"]), rel=1e-5)
        if step == 1:
            assert sorted(b.comm_state[cz.SHARED]) == ["1", "3"]  # both kernels compressed (bias, kernel x 2)
            for x, y in zip(leaves(b.params), leaves(a.params)):
                np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
    for got, want, r0, r1 in zip(leaves(b.params), leaves(a.params), old, residuals(b)):
        np.testing.assert_allclose(got + r0.mean(0) - r1.mean(0), want, rtol=0, atol=1e-6)


@functools.cache
def plain_diloco_losses():
    return tuple(run_steps(trainer_for("mlp", "2x4", strategy=jaxpar.DiLoCo(period=2)), 8, same_batch=True)[1])


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8", "powersgd:2"])
def test_diloco_with_a_codec_trains_and_its_replicas_restart_identical(codec):
    plain = plain_diloco_losses()  # the uncompressed run, once for the four codecs
    trainer = trainer_for("mlp", "2x4", strategy=jaxpar.DiLoCo(period=2, compress=codec))
    state, got = run_steps(trainer, 8, same_batch=True)
    assert got[-1] < got[0] - 0.3, got
    if codec != "powersgd:2":  # elementwise codecs: within 2e-3 of the uncompressed losses after 4 meetings
        np.testing.assert_allclose(got, plain, atol=2e-3)
    anchor = leaves(state.params)
    for x, theta in zip(anchor, leaves(state.strategy_state["params"])):
        for r in range(2):  # after the last meeting every replica holds the new anchor, bit for bit
            np.testing.assert_array_equal(theta[r], x)
    ReplicaCheck(trainer.state_shardings.params, trainer.mesh).check(state.params, 8)
    assert all(r.shape[0] == 2 for r in residuals(state)) if codec in ("int8", "powersgd:2") else True


@pytest.mark.slow
def test_post_local_warm_up_is_uncompressed_and_leaves_the_codec_state_alone():
    """local_after=2: the two synchronous steps average gradients as the uncompressed strategy does (bit for bit,
    float32 all-reduce, no all-gather over data); the residuals stay 0 until the first meeting."""
    plain = trainer_for("mlp", "8", strategy=jaxpar.LocalSGD(period=2, local_after=2))
    packed = trainer_for("mlp", "8", strategy=jaxpar.LocalSGD(period=2, local_after=2, compress="int8"))
    a, _ = run_steps(plain, 2)
    b, _ = run_steps(packed, 2)
    for x, y in zip(leaves(a.params), leaves(b.params)):
        np.testing.assert_array_equal(x, y)
    assert all((r == 0).all() for r in residuals(b))
    ops = [op for op in collective_ops(packed.compiled_step("sync", batch_for("mlp", 16)), packed.mesh)
           if op.axes == (REPLICA_AXIS,)]
    assert {op.kind for op in ops} == {"all-reduce"}
    for step in (2, 3):  # a local step, then the first meeting
        b, _ = packed.step(b, batch_for("mlp", 16, seed=step), step)
    assert any(np.abs(r).max() > 0 for r in residuals(b))


@pytest.mark.slow
def test_a_skipped_meeting_keeps_the_old_codec_state():
    """An outer step that overflows: the meeting is skipped as a whole, the int8 residuals included (they stay 0;
    the meeting that was skipped had made them non-zero)."""
    overflow = optax.chain(optax.scale(1e30), optax.scale(-1e30))
    trainer = trainer_for("mlp", "4x2", strategy=jaxpar.DiLoCo(period=1, outer_optimizer=overflow, compress="int8"))
    state, metrics = trainer.step(trainer.init(0), batch_for("mlp", 16), 0)
    assert metrics["skipped"] == 1.0
    assert all((r == 0).all() for r in residuals(state))
    flagging = trainer_for("mlp", "4x2", strategy=jaxpar.DiLoCo(period=1, outer_optimizer=overflow,
                                                                 compress="int8"), skip_nonfinite=False)
    state, metrics = flagging.step(flagging.init(0), batch_for("mlp", 16), 0)
    assert metrics["nonfinite"] == 1.0 and any(np.abs(r).max() > 0 for r in residuals(state))


@pytest.mark.parametrize("skip", [True, False])
def test_a_non_finite_replica_never_enters_the_residual(skip):
    """NaN in replica 3's rows: skipping, it brings its previous copy; flagging, it brings NaNs, which the codec
    keeps out of its residual (the meeting itself is then non-finite and flagged)."""
    trainer = trainer_for("mlp", "4x2", strategy=jaxpar.LocalSGD(period=1, compress="int8"), skip_nonfinite=skip)
    poisoned = batch_for("mlp", 16)
    poisoned["image"][12:] = np.nan
    state, metrics = trainer.step(trainer.init(0), poisoned, 0)
    assert all(np.isfinite(r).all() for r in residuals(state))
    assert all(np.isfinite(x).all() for x in leaves(state.params)) == skip
    if skip:
        np.testing.assert_array_equal(metrics["skipped_per_replica"], [0.0, 0.0, 0.0, 1.0])
        # the sender's residual of every leaf on the healthy replicas (an owner's is 0 outside the shard it owns)
        senders = leaves(state.comm_state[cz.OWN]["sender"])
        assert all(np.abs(r[:3]).max() > 0 for r in senders)


def test_int8_gives_a_nan_chunk_a_non_finite_scale():
    """A NaN must reach the mean (so the guard sees it), not be coded as 0 with scale 1 (NaN > 0 is False)."""
    x = np.ones(300, np.float32)
    x[3] = np.nan
    codes, scales = jax.jit(cz.int8_encode)(x)
    assert np.isnan(np.asarray(scales)[0]) and np.asarray(scales)[1] == np.float32(1 / 127)
    assert not np.isfinite(np.asarray(cz.int8_decode(codes, scales, 300))[:256]).any()


@pytest.mark.slow
def test_residuals_restore_onto_another_replica_count_averaged(tmp_path):
    strategy = jaxpar.LocalSGD(period=2, compress="int8")
    trainer = trainer_for("mlp", "8", strategy=strategy)
    state, _ = run_steps(trainer, 2)
    saved = residuals(state)
    assert any(np.abs(r[0] - r[1]).max() > 0 for r in saved)
    checkpoints = jaxpar.Checkpointer(tmp_path)
    checkpoints.save(2, state, trainer.strategy, trainer.num_replicas)
    checkpoints.wait()
    other = trainer_for("mlp", "2x4", strategy=jaxpar.LocalSGD(period=2, compress="int8"))
    restored, _, notes = checkpoints.restore(other)
    for kind, combine in (("sender", np.mean), ("owner", np.sum)):  # an owner holds only its shard: summed
        for r, got in zip(leaves(state.comm_state[cz.OWN][kind]), leaves(restored.comm_state[cz.OWN][kind])):
            assert got.shape == (2,) + r.shape[1:]
            np.testing.assert_allclose(got, np.broadcast_to(combine(r, 0), got.shape), rtol=1e-6, atol=1e-9)
    assert any("summed) and given to each of the 2 replicas" in n for n in notes)
    state, metrics = other.step(restored, batch_for("mlp", 16), 2)  # and it trains on
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,codec", [("psum", "bf16"), ("psum", "fp16"), ("psum", "int8"),
                                             ("psum", "powersgd:2"), ("ring", "bf16"), ("ring", "int8")])
def test_compiled_meeting_wire_bytes_match_the_codecs_count_on_8(algorithm, codec):
    trainer = trainer_for("mlp", "8", strategy=jaxpar.LocalSGD(period=2, allreduce=algorithm, compress=codec))
    trainer.init(0)
    ops = collective_ops(trainer.compiled_step("meet", batch_for("mlp", 16)), trainer.mesh)
    measured = sum(bytes_sent(op) for op in ops if op.axes == (REPLICA_AXIS,))
    shapes = [x.shape for x in jax.tree.leaves(trainer.abstract_state().params)]
    stated = trainer.strategy.communicator.wire_bytes(shapes, N)
    assert abs(measured - stated) <= 0.05 * stated, (measured, stated)
    plain = trainer_for("mlp", "8", strategy=jaxpar.LocalSGD(period=2, allreduce=algorithm))
    plain.init(0)
    uncompressed = sum(bytes_sent(op) for op in collective_ops(plain.compiled_step("meet", batch_for("mlp", 16)),
                                                               plain.mesh) if op.axes == (REPLICA_AXIS,))
    assert uncompressed > 0 and measured != uncompressed


def cli(args, capsys):
    code = run.main(["--model", "mlp", "--mesh", "8", "--steps", "2", "--eval-batches", "0", *args])
    out, err = capsys.readouterr()
    return code, out, err.strip()


@pytest.mark.parametrize("strategy", ["ssp", "asp"])
def test_compress_with_a_strategy_that_cannot_compress_is_one_line(strategy, capsys):
    code, _, err = cli(["--strategy", strategy, "--compress", "int8"], capsys)
    assert code == 2 and "\n" not in err and "Traceback" not in err
    assert err.endswith(f"--compress 'int8' does not apply to --strategy {strategy}; it applies to sync / "
                        f"local_sgd / diloco")


def test_a_bad_codec_with_local_sgd_is_one_line(capsys):
    code, _, err = cli(["--strategy", "diloco", "--compress", "powersgd:0"], capsys)
    assert code == 2 and "\n" not in err
    assert err.endswith("--compress 'powersgd:0': powersgd needs a rank R >= 1 after the colon, e.g. powersgd:4")
    with pytest.raises(jaxpar.JaxparError, match=r"compress='int4': is not one of"):
        jaxpar.LocalSGD(compress="int4")


@pytest.mark.slow
def test_local_sgd_compresses_without_an_explicit_allreduce(capsys):
    """Its meetings are always a hand-written exchange (psum by default), so unlike Sync() there is one to wrap."""
    assert isinstance(jaxpar.DiLoCo(compress="int8").communicator, cz.CompressedCommunicator)
    code, out, err = cli(["--strategy", "local_sgd", "--sync-period", "2", "--compress", "int8"], capsys)
    assert code == 0, err
