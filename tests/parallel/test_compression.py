"""Gradient compression (jaxpar.parallel.compression): each codec's encode / decode against numpy by hand, error
feedback's residual identity, PowerSGD below and at full rank, compressed Sync runs against uncompressed ones, the wire bytes
of the compiled step against the codec's own count, and the option's one-line refusals."""

import functools

import ml_dtypes
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
from jaxpar.parallel.partitioning import PER_REPLICA
from jaxpar.train.faults import ReplicaCheck
from tests.helpers import batch_for, trainer_for

N = 8


def per_replica(fn):
    """`fn` on each of 8 replicas (one row of every argument each); results stacked back."""
    mesh = jaxpar.make_mesh("8")
    wrapped = jax.shard_map(lambda *a: jax.tree.map(lambda x: x[None], fn(*jax.tree.map(lambda x: x[0], a))),
                            mesh=mesh, in_specs=PER_REPLICA, out_specs=PER_REPLICA, check_vma=False)
    return jax.jit(wrapped)


def exchange(algorithm="psum"):
    return cz.Exchange(REPLICA_AXIS, algorithm, None)


@pytest.mark.parametrize("algorithm", ["psum", "ring"])
def test_bf16_mean_is_the_float32_mean_of_bfloat16_values_rounded_once(algorithm):
    g = np.random.default_rng(0).normal(size=(N, 37)).astype(np.float32)
    codec = cz.Cast("bf16")
    out = per_replica(lambda x: codec.mean([x], [], (), exchange(algorithm), N, REPLICA_AXIS)[0][0])(g)
    wire = g.astype(ml_dtypes.bfloat16).astype(np.float32)
    if algorithm == "psum":  # all-to-all, float32 sum, one rounding to bf16, all-gather
        want = wire.sum(0).astype(ml_dtypes.bfloat16).astype(np.float32) / N
        np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(want, (N, 37)))
    else:  # the ring sums in bf16 hop by hop: within bf16's rounding of each partial sum
        np.testing.assert_allclose(np.asarray(out), np.broadcast_to(wire.mean(0), (N, 37)), rtol=2 ** -6, atol=1e-3)
    assert np.abs(np.asarray(out)[0] - g.mean(0)).max() > 0  # it is lossy: not the float32 mean


def test_fp16_scales_a_gradient_of_1e5_so_the_sum_does_not_overflow():
    g = np.full((N, 4), 3.0, np.float32)
    g[2, 1] = 1e5  # alone beyond float16's largest value, 65504
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(1e5))
    codec = cz.Cast("fp16")
    out = np.asarray(per_replica(lambda x: codec.mean([x], [], (), exchange("ring"), N, REPLICA_AXIS)[0][0])(g))
    assert np.isfinite(out).all()
    # scale 2^floor(log2(65504 / (8 x 1e5))) = 1/16; fp16 keeps 11 significant bits
    np.testing.assert_allclose(out[0], g.mean(0), rtol=2 ** -10)
    scale = per_replica(lambda x: jnp.stack(codec.scales([x], N, REPLICA_AXIS)))(g)
    np.testing.assert_array_equal(np.asarray(scale), np.full((N, 1), 1 / 16, np.float32))


def test_int8_codes_and_scales_match_numpy_by_hand():
    x = np.random.default_rng(1).normal(size=600).astype(np.float32)
    codes, scales = jax.jit(cz.int8_encode)(x)
    padded = np.pad(x, (0, 3 * 256 - 600)).reshape(3, 256)
    want_scales = np.abs(padded).max(1) / np.float32(127)
    want_codes = np.clip(np.round(padded / want_scales[:, None]), -127, 127).astype(np.int8)
    np.testing.assert_allclose(np.asarray(scales), want_scales, rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(codes), want_codes)
    decoded = np.asarray(cz.int8_decode(codes, scales, 600))
    assert np.abs(decoded - x).max() <= want_scales.max() / 2 * (1 + 1e-6)  # half a step at most


def test_a_non_finite_gradient_never_enters_the_residual():
    g = np.ones((N, 10), np.float32)
    g[3, 4], g[5, 0] = np.nan, np.inf
    for codec, shared in ((cz.Int8(), ()), (cz.PowerSGD(1), {"0": jnp.ones((5, 1))})):
        x = g.reshape(N, 2, 5) if shared else g

        def one(x, r, codec=codec, shared=shared):
            residuals = [r] if shared else [r, r]  # int8: the owner's and the sender's
            (mean,), new, _ = codec.mean([x], residuals, shared, exchange(), N, REPLICA_AXIS)
            return mean, new

        mean, new = (np.asarray(a) for a in per_replica(one)(x, np.zeros_like(x)))
        assert np.isfinite(new).all(), type(codec).__name__
        assert not np.isfinite(mean).all()  # the step itself is non-finite: the trainer's guard sees it


def test_powersgd_below_full_rank_is_one_numpy_power_iteration_with_error_feedback():
    # the production codec on 8 replicas, rank 3 of a 12 x 9 gradient (fed as 12 x 3 x 3), each replica with its own
    # gradient and old residual: P = mean(M Q), Q' = mean(M^T orth(P)), mean = orth(P) Q'^T, residual = M - mean
    rng = np.random.default_rng(3)
    g = rng.normal(size=(N, 12, 3, 3)).astype(np.float32)
    old = 0.1 * rng.normal(size=(N, 12, 3, 3)).astype(np.float32)
    q = rng.normal(size=(9, 3)).astype(np.float32)
    codec = cz.PowerSGD(3)
    assert codec.compresses(g.shape[1:])

    def one(x, r):
        (mean,), (new,), shared = codec.mean([x], [r], {"0": jnp.asarray(q)}, exchange("ring"), N, REPLICA_AXIS)
        return mean, new, shared["0"]

    mean, new, new_q = (np.asarray(a) for a in per_replica(one)(g, old))
    m = (g + old).reshape(N, 12, 9)
    p_hat, _ = np.linalg.qr(np.mean(m @ q, axis=0))
    want_q = np.mean(m.transpose(0, 2, 1) @ p_hat, axis=0)
    want = p_hat @ want_q.T
    np.testing.assert_allclose(new_q, np.broadcast_to(want_q, new_q.shape), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(mean.reshape(N, 12, 9), np.broadcast_to(want, (N, 12, 9)), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new.reshape(N, 12, 9), m - want, rtol=1e-4, atol=1e-5)
    assert np.abs(want - m.mean(0)).max() > 0.1  # rank 3 of 9 is lossy: this is not the plain mean


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_powersgd_at_full_rank_equals_the_uncompressed_mean(shape):
    g = np.random.default_rng(4).normal(size=(N, *shape)).astype(np.float32)
    rank = min(shape)
    codec = cz.PowerSGD(rank)
    q0 = jax.random.normal(jax.random.key(0), (shape[1], rank))

    def one(x, r):
        (mean,), (new,), shared = codec.mean([x], [r], {"0": q0}, exchange("ring"), N, REPLICA_AXIS)
        return mean, new

    mean, new = (np.asarray(a) for a in per_replica(one)(g, np.zeros_like(g)))
    np.testing.assert_allclose(mean, np.broadcast_to(g.mean(0), mean.shape), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new + mean, g, rtol=1e-4, atol=1e-5)  # residual identity: sent = the mean


def test_powersgd_leaves_vectors_and_small_matrices_uncompressed():
    codec = cz.PowerSGD(4)
    assert not codec.compresses((100,))
    assert not codec.compresses((8, 8))  # (8 + 8) x 4 = 64 = 8 x 8: no saving
    assert codec.compresses((64, 3, 3, 8))  # 64 x 72: (64 + 72) x 4 < 64 x 72
    state = cz.CompressedCommunicator(jaxpar.communicator("psum"), codec).init(
        {"w": jnp.zeros((64, 72)), "b": jnp.zeros(72)}, num_replicas=2)
    assert state[cz.OWN]["w"].shape == (2, 64, 72) and list(state[cz.SHARED]) == ["1"]  # leaves: b, w
    assert state[cz.SHARED]["1"].shape == (72, 4)


def trainer_shardings(mesh, codec):
    return trainer_for("mlp", mesh, strategy=jaxpar.Sync(allreduce="ring", compress=codec)).state_shardings.params


def losses(trainer, steps=6):
    state, out = trainer.init(0), []
    batch = batch_for("mlp", 16)
    for _ in range(steps):
        state, metrics = trainer.step(state, batch)
        out.append(float(metrics["loss"]))
    return state, out


@functools.cache
def plain_losses(mesh: str, algorithm: str) -> tuple:
    """The uncompressed run's losses, once per mesh and algorithm."""
    return tuple(losses(trainer_for("mlp", mesh, strategy=jaxpar.Sync(allreduce=algorithm)))[1])


def test_compress_none_is_todays_sync_bit_for_bit():
    """compress="none" is the uncompressed ring bit for bit, and both are plain SGD: a hand-written jax.jit step on
    one device over the whole batch gives the same parameters (atol 2e-5: the ring sums in another order)."""
    from flax import nnx

    import models

    trainer = trainer_for("mlp", "8", strategy=jaxpar.Sync(allreduce="ring", compress="none"))
    start = jax.device_get(trainer.init(0))
    a, _ = losses(trainer, 3)
    b, _ = losses(trainer_for("mlp", "8", strategy=jaxpar.Sync(allreduce="ring")), 3)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    def loss_of(params, batch):
        return models.LOSSES["mlp"](nnx.merge(trainer.ctx.graphdef, params, start.model_state), batch)[0]

    sgd = jax.jit(lambda p, batch: jax.tree.map(lambda w, g: w - 0.1 * g, p, jax.grad(loss_of)(p, batch)))
    params = start.params
    for _ in range(3):
        params = sgd(params, batch_for("mlp", 16))
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=2e-5)
    assert max(np.abs(np.asarray(x) - np.asarray(y)).max()
               for x, y in zip(jax.tree.leaves(start.params), jax.tree.leaves(params))) > 1e-3  # it moved


@pytest.mark.slow
@pytest.mark.parametrize("mesh,algorithm,codec", [  # each codec at least once, int8 (two code paths) under both
    ("8", "psum", "bf16"), ("8", "psum", "int8"), ("8", "psum", "powersgd:2"), ("2x4", "ring", "fp16"),
    ("2x4", "ring", "int8")])
def test_a_compressed_sync_run_trains(mesh, algorithm, codec):
    plain = plain_losses(mesh, algorithm)
    state, got = losses(trainer_for("mlp", mesh, strategy=jaxpar.Sync(allreduce=algorithm, compress=codec)))
    assert got[-1] < got[0] - 0.2, got
    if codec in ("bf16", "fp16", "int8"):  # 6 steps of SGD(0.1): within 2e-3 of the uncompressed losses
        np.testing.assert_allclose(got, plain, atol=2e-3)
    # every device's copy of each parameter agrees (a replicated leaf's int8 chunks are its own)
    ReplicaCheck(trainer_shardings(mesh, codec), jaxpar.make_mesh(mesh)).check(state.params, 6)
    residuals = jax.tree.leaves(state.comm_state.get(cz.OWN, ()))
    assert all(r.shape[0] == int(mesh.split("x")[0]) for r in residuals)


@pytest.mark.parametrize("algorithm,codec", [("psum", "bf16"), ("psum", "fp16"), ("psum", "int8"),
                                             ("psum", "powersgd:2"), ("ring", "bf16"), ("ring", "int8")])
@pytest.mark.slow
def test_compiled_wire_bytes_match_the_codecs_count_on_8(algorithm, codec):
    trainer = trainer_for("mlp", "8", strategy=jaxpar.Sync(allreduce=algorithm, compress=codec))
    trainer.init(0)
    ops = collective_ops(trainer.compiled_step("sync", batch_for("mlp", 16)), trainer.mesh)
    measured = sum(bytes_sent(op) for op in ops if op.axes == (REPLICA_AXIS,))
    shapes = [x.shape for x in jax.tree.leaves(trainer.abstract_state().params)]
    stated = trainer.strategy.communicator.wire_bytes(shapes, N)
    assert abs(measured - stated) <= 0.05 * stated, (measured, stated)


@pytest.mark.parametrize("mesh,algorithm", [("2x4", "psum"), ("2x4", "ring"), ("data=2,fsdp=2,model=2", "psum"),
                                            ("data=2,fsdp=2,model=2", "ring"), ("4x2", "ps")])
@pytest.mark.slow
def test_powersgd_sends_each_devices_rows_of_its_factors_when_a_replica_spans_devices(mesh, algorithm):
    """The digits MLP's W1 (64 x 128) is split over model by columns, W2 (128 x 10) by rows: each device sends its
    rows of the factors split like the matrix, the count says so, and the compiled step sends exactly that (plus
    the loss / accuracy mean); counted whole, the factors would be 1.34-1.83 times as many bytes (this tiny MLP)."""
    from jaxpar.cost import codecs
    from jaxpar.cost.explain import busiest_sent

    trainer = trainer_for("mlp", mesh, strategy=jaxpar.Sync(allreduce=algorithm, compress="powersgd:2"))
    trainer.init(0)
    ops = [op for op in collective_ops(trainer.compiled_step("sync", batch_for("mlp", 16)), trainer.mesh)
           if op.axes == (REPLICA_AXIS,)]
    measured = busiest_sent(ops, 8)[REPLICA_AXIS]
    comm, n = trainer.strategy.communicator, trainer.num_replicas
    shapes, splits = codecs.gradient_shapes(trainer), codecs.gradient_splits(trainer)
    stated = comm.wire_bytes(shapes, n, splits)
    assert 0 <= measured - stated <= 0.02 * stated, (measured, stated)  # (+ 8 bytes of metrics on 2 replicas)
    assert comm.wire_bytes(shapes, n) > 1.3 * stated  # the whole factors' count, which the step no longer sends


@pytest.mark.parametrize("mesh,algorithm", [("2x4", "ring"), ("data=2,fsdp=2,model=2", "psum")])
@pytest.mark.slow
def test_powersgd_on_a_replica_of_several_devices_equals_it_on_a_replica_of_one(mesh, algorithm):
    """Splitting the factors' exchange over model / fsdp changes who sends which rows, not the mean: 4 steps of
    PowerSGD R=2 with error feedback on `mesh` give the parameters of the same run on 2 devices (one per replica),
    within float32 rounding of the differently split matmuls."""
    def run_on(trainer):
        state = trainer.init(0)
        for i in range(4):
            state, _ = trainer.step(state, batch_for("mlp", 16, seed=i))
        return jax.tree.map(np.asarray, jax.device_get(state.params))

    import models
    from tests.helpers import TINY

    one = jaxpar.Trainer(model=models.factory(TINY["mlp"].replace(dropout=0.0)), loss_fn=models.LOSSES["mlp"],
                         optimizer=optax.sgd(0.1), mesh=jaxpar.make_mesh("2", devices=jax.devices()[:2]),
                         strategy=jaxpar.Sync(allreduce=algorithm, compress="powersgd:2"))
    split = trainer_for("mlp", mesh, strategy=jaxpar.Sync(allreduce=algorithm, compress="powersgd:2"))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), run_on(split), run_on(one))


def test_factor_layout_follows_the_matrix_rows_and_columns():
    """The matrix is (dimensions before k, the rest), k = `matrix_split`: P is cut like dimension 0 when no other
    row dimension is cut, Q like dimension k when no later dimension is cut (its rows or columns are then whole
    blocks of the matrix), else whole; axes of size 1 cut nothing."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxpar.parallel import partitioning as shd

    mesh = jaxpar.make_mesh("data=2,fsdp=2,model=2")
    cases = [(P(None, "model"), 2, 1, (1, 2), (P(None, None), P("model", None))),
             (P("model", None), 2, 1, (2, 1), (P("model", None), P(None, None))),
             (P(("fsdp", "model"), None), 2, 1, (4, 1), (P(("fsdp", "model"), None), P(None, None))),
             (P("data", "fsdp"), 2, 1, (1, 2), (P(None, None), P("fsdp", None))),  # data is not inside a replica
             (P(None, "model", None), 3, 1, (1, 2, 1), (P(None, None), P("model", None))),  # (d, heads, head_dim)
             (P(None, None, None, "model"), 4, 3, (1, 1, 1, 2), (P(None, None), P("model", None))),  # a conv's cout
             (P("stage", None, "model"), 3, 2, (1, 1, 2), (P(None, None), P("model", None))),  # (layers, in, out)
             (P(None, "model", None), 3, 2, (1, 2, 1), (P(None, None), P(None, None)))]  # a cut inside the rows
    for spec, ndim, k, splits, specs in cases:
        sharding = NamedSharding(mesh, spec)
        assert shd.within_replica_splits(sharding, ndim) == splits, spec
        assert shd.factor_specs(sharding, ndim, k) == specs, spec
    assert shd.factor_splits((1, 1, 1, 2)) == (1, 1) and shd.factor_splits((2, 4, 1)) == (2, 4)
    assert shd.factor_splits((1, 1, 1, 2), 3) == (1, 2) and shd.factor_splits((2, 4, 1), 2) == (1, 1)
    assert [cz.powersgd.matrix_split(s) for s in [(64, 128), (2, 64, 256), (3, 3, 8, 16), (128, 4, 32)]] == [1, 2, 3, 1]
    codec = cz.PowerSGD(4)
    # W (64 x 128) split by columns over 4: P whole 64 x 4, Q 32 x 4; a (128,) bias over 4: 32 floats
    assert codec.payload([(64, 128), (128,)], 2, [(1, 4), (4,)]) == {"all-reduce": 4 * (64 * 4 + 32),
                                                                     "all-reduce (Q)": 4 * 32 * 4}


@pytest.mark.parametrize("value,message", [
    ("powersgd:0", "--compress 'powersgd:0': powersgd needs a rank R >= 1 after the colon, e.g. powersgd:4"),
    ("powersgd:x", "--compress 'powersgd:x': powersgd needs a rank R >= 1 after the colon, e.g. powersgd:4"),
    ("int4", "--compress 'int4': is not one of: none, bf16, fp16, int8, powersgd:R (int8 and powersgd:R also as "
             "int8:noef, powersgd:R:noef: without error feedback)"),
])
def test_bad_compress_values_are_one_line(value, message, capsys):
    assert run.main(["--model", "mlp", "--mesh", "8", "--steps", "1", "--allreduce", "psum", "--compress",
                     value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(message) and "\n" not in err and "Traceback" not in err


def test_compress_without_an_allreduce_trains_on_the_hand_written_psum_with_one_note(capsys):
    assert run.main(["--model", "mlp", "--mesh", "2x4", "--steps", "2", "--compress", "bf16"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "without an allreduce" in line]
    assert notes == ["jaxpar: note: compress bf16 without an allreduce: the gradient is averaged by the hand-written "
                     "psum (allreduce psum), since the compiler's averaging cannot be compressed; each replica draws "
                     "its own dropout masks and BatchNorm statistics"]
    assert "done: 2 steps" in out
    strategy = jaxpar.Sync(compress="int8")
    assert strategy.allreduce == "psum" and strategy.communicator.codec.name == "int8"
    assert len(strategy.notes) == 1 and strategy.notes[0].startswith("compress int8 without an allreduce")
    assert trainer_for("mlp", "8", strategy=strategy).notes[-1] == strategy.notes[0]  # the trainer logs it
    assert jaxpar.Sync(allreduce="ring", compress="int8").notes == [] and jaxpar.Sync().notes == []


def test_compress_does_not_apply_to_ssp(capsys):  # (local SGD / DiLoCo: tests/parallel/test_compression_meetings.py)
    assert run.main(["--model", "mlp", "--mesh", "8", "--steps", "1", "--strategy", "ssp", "--compress",
                     "bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--compress" in err and "sync" in err and "\n" not in err


@pytest.mark.slow
def test_residuals_restore_onto_another_replica_count_averaged(tmp_path):
    strategy = jaxpar.Sync(allreduce="psum", compress="int8")
    trainer = trainer_for("mlp", "8", strategy=strategy)
    state, _ = losses(trainer, 2)
    saved = [np.asarray(r) for r in jax.tree.leaves(state.comm_state[cz.OWN])]
    assert any(np.abs(r[0] - r[1]).max() > 0 for r in saved)  # residuals differ per replica
    checkpoints = jaxpar.Checkpointer(tmp_path)
    checkpoints.save(2, state, trainer.strategy, trainer.num_replicas)
    checkpoints.wait()
    other = trainer_for("mlp", "2x4", strategy=jaxpar.Sync(allreduce="psum", compress="int8"))
    restored, _, notes = checkpoints.restore(other)
    owners = len(jax.tree.leaves(state.comm_state[cz.OWN]["owner"]))  # (the dict's leaves: owner, then sender)
    for k, (r, got) in enumerate(zip(saved, jax.tree.leaves(restored.comm_state[cz.OWN]))):
        assert got.shape == (2,) + r.shape[1:]
        # the senders' residuals averaged; the shard owners' (each replica its own elements) summed: the whole error
        want = r.sum(0) if k < owners else r.mean(0)
        np.testing.assert_allclose(np.asarray(got), np.broadcast_to(want, got.shape), rtol=1e-6, atol=1e-9)
    assert any("averaged (int8's shard-owner residuals summed) and given to each of the 2 replicas" in n
               for n in notes)


def test_a_communicator_written_before_init_took_the_replica_count_still_works():
    from jaxpar.parallel.collectives import Communicator

    class Old(Communicator):  # a user's subclass: init(params) only, as before compression
        def init(self, params):
            return ()

    trainer = trainer_for("mlp", "8", strategy=jaxpar.Sync(Old("ring")))
    state, _ = trainer.step(trainer.init(0), batch_for("mlp"))
    assert state.comm_state == () and int(state.step) == 1
