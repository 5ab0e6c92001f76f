"""The gradient's fsdp leg compressed (jaxpar.parallel.fsdp_reduce): each codec's reduce-scatter against numpy by
hand, the uncompressed leg against today's step, compressed training on data x fsdp meshes against uncompressed,
the fsdp bytes of the compiled step against the codec's count, and the minimal program showing that the default
Sync()'s reduction cannot be compressed (benchmarks/fsdp_hook.py)."""

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxpar
from benchmarks import fsdp_hook
from jaxpar.cost.hlo import bytes_sent, collective_ops
from jaxpar.cost.strategy_costs import variant_shares
from jaxpar.parallel import compression as cz
from jaxpar.parallel import fsdp_reduce
from jaxpar.parallel.collectives import communicator
from jaxpar.parallel.mesh import FSDP_AXIS, REPLICA_AXIS, TENSOR_AXIS
from jaxpar.train.faults import ReplicaCheck
from tests.helpers import batch_for, trainer_for

D, F = 2, 2  # data=2,fsdp=2,model=2
SPECS = {  # every way a parameter can sit over fsdp, model-split dimensions included
    "a": ((8, 6), P(FSDP_AXIS, TENSOR_AXIS)),
    "b": ((12, 4), P((TENSOR_AXIS, FSDP_AXIS))),  # one dimension over both, model first
    "c": ((4, 8), P(None, (FSDP_AXIS, TENSOR_AXIS))),
    "d": ((5,), P()),  # whole over fsdp
    "e": ((6, 300), P(TENSOR_AXIS, None)),  # whole over fsdp, split over model; > 1 int8 chunk
}


def run_leg(codec, grads):
    """fsdp_reduce.reduce_scatter on data=2,fsdp=2,model=2: `grads[k]` is [D, F, *shape] (replica d, fsdp device
    f's unreduced gradient); returns [D, *shape] per leaf, and the output shardings."""
    mesh = jaxpar.make_mesh("data=2,fsdp=2,model=2")
    shardings = {k: NamedSharding(mesh, spec) for k, (_, spec) in SPECS.items()}

    def per_replica(g):
        out = fsdp_reduce.reduce_scatter(jax.tree.map(lambda x: x[0], g), shardings, mesh, codec)
        return jax.tree.map(lambda x: x[None], out)

    f = jax.jit(jax.shard_map(per_replica, mesh=mesh, in_specs=P(REPLICA_AXIS), out_specs=P(REPLICA_AXIS),
                              axis_names={REPLICA_AXIS}, check_vma=False))
    out = f(grads)
    return {k: np.asarray(v) for k, v in out.items()}, mesh


def device_slices(mesh, shape, spec):
    """(replica d, the index a device holds of a [D, *shape] array laid out (data, *spec)) for every device."""
    sharding = NamedSharding(mesh, P(REPLICA_AXIS, *spec))
    for index in sharding.devices_indices_map((D,) + shape).values():
        yield index[0].start or 0, index[1:]


def int8_roundtrip(v):
    flat = v.ravel()
    return np.asarray(cz.int8_decode(*cz.int8_encode(jnp.asarray(flat)), flat.size)).reshape(v.shape)


def bf16(v):
    return v.astype(ml_dtypes.bfloat16).astype(np.float32)


def expected(codec, grads, k, d, index):
    """What device (replica d) holding `index` of leaf k must end with, computed by hand from the F partial
    gradients: the mean over fsdp of what each fsdp device put on the wire for that block."""
    parts = [grads[k][d, f][index] for f in range(F)]
    whole = SPECS[k][1] == P() or FSDP_AXIS not in str(SPECS[k][1])
    if codec is None:
        return sum(parts) / F
    if codec == "int8" and whole:  # the two-shot all-reduce: checked against its bound (below)
        return None
    if codec == "int8":  # each sender quantizes this device's block per 256-element chunk
        return sum(int8_roundtrip(p) for p in parts) / F
    if codec == "bf16" and whole:  # compression's psum form: a float32 sum rounded once to bf16
        return bf16(sum(bf16(p) for p in parts)) / F
    return sum(bf16(p) for p in parts) / F  # bf16, split: each block summed in float32


@pytest.mark.parametrize("codec", [None, "bf16", "int8"])
def test_each_codecs_reduce_scatter_matches_numpy_by_hand(codec):
    rng = np.random.default_rng(0)
    grads = {k: rng.normal(size=(D, F) + shape).astype(np.float32) for k, (shape, _) in SPECS.items()}
    out, mesh = run_leg(cz.parse_codec(codec), grads)
    for k, (shape, spec) in SPECS.items():
        assert out[k].shape == (D,) + shape
        for d, index in device_slices(mesh, shape, spec):
            want = expected(codec, grads, k, d, index)
            if want is None:  # int8 on a leaf whole over fsdp: each sender's and the owner's rounding, half a step
                parts = np.stack([grads[k][d, f][index] for f in range(F)])  # each, of a scale <= the absmax / 127
                bound = np.abs(parts).max() / 254 + np.abs(parts.mean(0)).max() / 254
                np.testing.assert_allclose(out[k][d][index], parts.mean(0), rtol=0, atol=bound * (1 + 1e-6),
                                           err_msg=f"{codec} {k}")
                continue
            np.testing.assert_allclose(out[k][d][index], want, rtol=1e-6, atol=1e-7, err_msg=f"{codec} {k}")
    if codec is not None:  # lossy: not the exact mean
        assert np.abs(out["a"] - grads["a"].mean(1)).max() > 0


def test_fp16_leg_is_within_float16_rounding_and_scales_a_gradient_of_1e5():
    rng = np.random.default_rng(1)
    grads = {k: rng.normal(size=(D, F) + shape).astype(np.float32) for k, (shape, _) in SPECS.items()}
    grads["a"][1, 0, 3, 2] = 1e5  # alone beyond float16's 65504: the per-leaf scale brings it into range
    out, _ = run_leg(cz.parse_codec("fp16"), grads)
    for k in SPECS:
        assert np.isfinite(out[k]).all(), k
        # each of the F values is rounded once to float16's 11 significant bits, then summed in float32 (a leaf
        # whole over fsdp: its float32 sum is rounded to float16 once more, compression's psum form)
        whole = FSDP_AXIS not in str(SPECS[k][1])
        bound = 2 ** (-10 if whole else -11) * np.abs(grads[k]).mean(1) + 1e-7
        assert (np.abs(out[k] - grads[k].mean(1)) <= bound).all(), k
    assert out["a"][1, 3, 2] == pytest.approx(grads["a"][1, :, 3, 2].mean(), rel=2 ** -11)


class Float32:
    """A user's codec that compresses nothing: the fsdp leg is then XLA's float32 reduce-scatter."""

    name, elementwise = "float32", True

    def init(self, params):
        return (), ()

    def mean(self, leaves, own, shared, exchange, n, axis_name):
        return exchange.mean(leaves), own, shared

    def payload(self, shapes, n):
        return {"all-reduce": 4 * sum(int(np.prod(s)) for s in shapes)}


def params_after(strategy, mesh, steps=3, dropout=0.0):
    trainer = trainer_for("mlp", mesh, strategy=strategy, dropout=dropout)
    state, losses = trainer.init(0), []
    for _ in range(steps):
        state, metrics = trainer.step(state, batch_for("mlp", 16))
        losses.append(float(metrics["loss"]))
    return trainer, state, losses


@pytest.mark.parametrize("mesh", ["data=2,fsdp=2,model=2", "data=2,fsdp=4"])
def test_the_float32_reduce_scatter_equals_todays_step(mesh):
    """data=2,fsdp=2,model=2: today's pmean over fsdp vs the reduce-scatter; data=2,fsdp=4: today's compiler-split
    rows vs rows split by hand (a codec splits them whenever fsdp > 1)."""
    _, today, a = params_after(jaxpar.Sync("psum"), mesh)
    _, hand, b = params_after(jaxpar.Sync(cz.CompressedCommunicator(communicator("psum"), Float32())), mesh)
    np.testing.assert_allclose(b, a, rtol=1e-6)
    for x, y in zip(jax.tree.leaves(hand.params), jax.tree.leaves(today.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_compress_none_is_todays_step_bit_for_bit_on_fsdp_and_model():
    _, a, _ = params_after(jaxpar.Sync("psum", compress="none"), "data=2,fsdp=2,model=2", dropout=0.1)
    _, b, _ = params_after(jaxpar.Sync("psum"), "data=2,fsdp=2,model=2", dropout=0.1)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("mesh", ["data=2,fsdp=2,model=2", "data=2,fsdp=4"])
@pytest.mark.slow
def test_compressed_fsdp_training_keeps_replicas_identical_and_tracks_uncompressed(mesh):
    _, _, plain = params_after(jaxpar.Sync("psum"), mesh, steps=6)
    for codec in ("bf16", "fp16", "int8", "powersgd:2"):
        trainer, state, got = params_after(jaxpar.Sync("psum", compress=codec), mesh, steps=6)
        assert got[-1] < got[0] - 0.2, (codec, got)
        if codec != "powersgd:2":  # 6 steps of SGD(0.1), both legs lossy: within 2e-3 of the uncompressed losses
            np.testing.assert_allclose(got, plain, atol=2e-3, err_msg=codec)
        ReplicaCheck(trainer.state_shardings.params, trainer.mesh).check(state.params, 6)


def fsdp_gradient_bytes(trainer):
    """Bytes the busiest device sends over exactly fsdp in collectives jaxpar writes (the partitioner's ZeRO-3
    parameter all-gathers carry no primitive name): the gradient's leg and the 8-byte loss / accuracy mean (under
    PowerSGD also its Q's partial sums over fsdp, which XLA combines into the same all-reduce)."""
    ops = collective_ops(trainer.compiled_step("sync", batch_for("mlp", 16)), trainer.mesh)
    return sum(bytes_sent(op) for op in ops if op.axes == (FSDP_AXIS,) and fsdp_hook.written_by_jaxpar(op))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data=2,fsdp=2,model=2", "data=2,fsdp=4"])
@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8", "powersgd:2"])
def test_compiled_fsdp_bytes_match_the_codecs_count(mesh, codec):
    trainer = trainer_for("mlp", mesh, strategy=jaxpar.Sync("psum", compress=codec))
    trainer.init(0)
    measured = fsdp_gradient_bytes(trainer)
    stated = fsdp_reduce.step_wire_bytes(cz.parse_codec(codec), trainer.state_shardings.params,
                                         trainer.abstract_state().params)
    assert abs(measured - stated) <= 0.05 * stated, (measured, stated)


def test_the_partitioners_reduction_has_no_hook_and_shard_map_has_one():
    mesh = jaxpar.make_mesh("fsdp=8")
    found = fsdp_hook.programs(mesh)
    jaxpr, compiled = found["grad"]
    assert fsdp_hook.jaxpr_collectives(jaxpr) == []  # jax.grad returns the reduced gradient: no reduction to wrap
    plain = fsdp_hook.fsdp_collectives(compiled, mesh)
    gradient = 64 * 32 * 4
    assert plain[("all-reduce", (4,), 2 * 7 / 8 * gradient)] == 1  # float32, the whole gradient, by the partitioner
    # a codec applied to what jax.grad returns changes nothing on the wire
    assert fsdp_hook.fsdp_collectives(found["grad, then int8"][1], mesh) == plain
    manual = fsdp_hook.fsdp_collectives(found["shard_map, int8"][1], mesh)
    assert manual[("all-to-all", (1,), 7 * 64 * 32 / 8)] == 1  # int8 codes: 1 byte per element, (F-1)/F of them
    assert not any(kind == "all-reduce" for kind, _, _ in manual)


def test_a_nan_row_on_one_fsdp_device_skips_the_step_and_keeps_the_residuals():
    trainer = trainer_for("mlp", "data=2,fsdp=4", strategy=jaxpar.Sync("psum", compress="int8"))
    state, _ = trainer.step(trainer.init(0), batch_for("mlp", 16))
    before = [np.asarray(r) for r in jax.tree.leaves(state.comm_state[cz.OWN])]
    params = [np.asarray(p) for p in jax.tree.leaves(state.params)]
    batch = batch_for("mlp", 16, seed=1)
    batch["image"][2] = np.nan  # replica 0, fsdp device 1's rows: a non-finite partial gradient on the fsdp leg
    state, metrics = trainer.step(state, batch)
    assert float(metrics["skipped"]) == 1.0
    for old, new in zip(before, jax.tree.leaves(state.comm_state[cz.OWN])):
        np.testing.assert_array_equal(np.asarray(new), old)
    for old, new in zip(params, jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(new), old)


def test_gradient_accumulation_with_a_compressed_fsdp_leg_matches_one_big_batch():
    _, one, a = params_after(jaxpar.Sync("psum", compress="int8"), "data=2,fsdp=4")
    trainer = trainer_for("mlp", "data=2,fsdp=4", strategy=jaxpar.Sync("psum", compress="int8"), grad_accum=2)
    state, b = trainer.init(0), []
    for _ in range(3):
        state, metrics = trainer.step(state, batch_for("mlp", 16))
        b.append(float(metrics["loss"]))
    np.testing.assert_allclose(b, a, rtol=1e-5)  # the microbatches' mean gradient is quantized once, as one batch's


def test_explain_counts_the_compressed_fsdp_leg_and_does_not_flag_its_all_to_all():
    trainer = trainer_for("mlp", "data=2,fsdp=4", strategy=jaxpar.Sync("psum", compress="int8"))
    trainer.init(0)
    sync = jaxpar.explain(trainer, batch_for("mlp", 16))["variants"]["sync"]
    fsdp = [c for c in sync["communication"] if c["axes"] == FSDP_AXIS]
    assert [c["unexpected"] for c in fsdp if c["kind"] == "all-to-all"] == [0]
    # explain's "sent by the busiest device ... over fsdp" = the partitioner's parameter all-gathers + the leg
    ops = collective_ops(trainer.compiled_step("sync", batch_for("mlp", 16)), trainer.mesh)
    gathers = sum(bytes_sent(op) for op in ops if op.axes == (FSDP_AXIS,) and op.kind == "all-gather"
                  and not fsdp_hook.written_by_jaxpar(op))
    assert sync["busiest_sent"][FSDP_AXIS] == gathers + fsdp_gradient_bytes(trainer)
    stated = fsdp_reduce.step_wire_bytes(cz.Int8(), trainer.state_shardings.params, trainer.abstract_state().params)
    assert abs(sync["busiest_sent"][FSDP_AXIS] - gathers - stated) <= 0.05 * stated


def test_local_sgd_with_a_codec_leaves_its_steps_fsdp_leg_uncompressed():
    """LocalSGD's codec is for its meetings: no step of it sends a codec's all-to-all over fsdp."""
    trainer = trainer_for("mlp", "data=2,fsdp=4", strategy=jaxpar.LocalSGD(period=2, compress="int8"))
    trainer.init(0)
    for variant in variant_shares(trainer.strategy):
        ops = collective_ops(trainer.compiled_step(variant, batch_for("mlp", 16)), trainer.mesh)
        assert not [op for op in ops if op.kind == "all-to-all" and op.axes == (FSDP_AXIS,)], variant
