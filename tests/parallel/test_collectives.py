"""allreduce_mean equals lax.pmean for every algorithm and axis size; the compiled HLO has the textbook steps."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.collectives import ALLREDUCE_ALGORITHMS, allreduce_mean, default_torus_x, theoretical_traffic
import jaxpar
from jaxpar.errors import ConfigError, OptionError, cli_message
from jaxpar.cost.hlo import collective_stats

AUTO = jax.sharding.AxisType.Auto


def data_mesh(n):
    return jax.make_mesh((n,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:n])


def stacked_tree(n, seed=0):
    """Per-device gradients stacked on a leading [n] axis; every device holds different values."""
    rng = np.random.default_rng(seed)
    return {
        "scalar": rng.normal(size=(n,)).astype(np.float32),
        "odd": rng.normal(size=(n, 7)).astype(np.float32),
        "matrix": rng.normal(size=(n, 3, 5)).astype(np.float32),
        # Multiples of 1/4 below 8: every partial sum is exact in bf16, so any summation order agrees exactly.
        "half": (rng.integers(-32, 32, size=(n, 4)) / 4).astype(jnp.bfloat16),
    }


def mean_and_reference(mesh, algorithm, torus_x=None, axis_names=None):
    """Jitted fn: stacked tree -> (allreduce_mean, lax.pmean), both still stacked per device."""
    def body(tree):
        local = jax.tree.map(lambda a: a[0], tree)
        ours = allreduce_mean(local, "data", algorithm, torus_x=torus_x)
        ref = lax.pmean(local, "data")
        return jax.tree.map(lambda a: a[None], (ours, ref))

    kwargs = {"axis_names": axis_names} if axis_names else {}
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), **kwargs))


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("algorithm", ALLREDUCE_ALGORITHMS)
def test_allreduce_mean_equals_pmean(algorithm, n):
    tree = stacked_tree(n, seed=n)
    ours, ref = mean_and_reference(data_mesh(n), algorithm)(tree)
    for name, stacked in tree.items():
        got, want = np.asarray(ours[name], np.float32), np.asarray(ref[name], np.float32)
        assert ours[name].dtype == stacked.dtype and ours[name].shape == stacked.shape, name
        expected = stacked.astype(np.float64).mean(axis=0)
        if stacked.dtype == jnp.bfloat16:  # exact sums; the mean is one correctly rounded division
            np.testing.assert_array_equal(got, want, err_msg=name)
            np.testing.assert_allclose(got, np.broadcast_to(expected, got.shape), rtol=2**-8, err_msg=name)
        else:
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=name)
            np.testing.assert_allclose(got, np.broadcast_to(expected, got.shape), rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("n,torus_x", [(6, 3), (8, 4), (8, 8), (8, 1)])
def test_torus_explicit_grids(n, torus_x):
    tree = stacked_tree(n, seed=10 + torus_x)
    ours, ref = mean_and_reference(data_mesh(n), "torus2d", torus_x=torus_x)(tree)
    for name in tree:
        np.testing.assert_allclose(np.asarray(ours[name], np.float32), np.asarray(ref[name], np.float32), atol=1e-6)


@pytest.mark.parametrize("algorithm", ["ring", "torus2d", "ps"])
def test_partial_manual_mesh_with_model_sharded_leaf(algorithm):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))
    rng = np.random.default_rng(1)
    w = jax.device_put(rng.normal(size=(2, 3, 8)).astype(np.float32), NamedSharding(mesh, P("data", None, "model")))
    b = jax.device_put(rng.normal(size=(2, 5)).astype(np.float32), NamedSharding(mesh, P("data")))
    ours, ref = mean_and_reference(mesh, algorithm, axis_names={"data"})({"w": w, "b": b})
    for name, stacked in (("w", w), ("b", b)):
        np.testing.assert_allclose(np.asarray(ours[name]), np.asarray(ref[name]), atol=1e-6)
        np.testing.assert_allclose(np.asarray(ours[name][0]), np.asarray(stacked).mean(0), atol=1e-6)


def compiled_stats(algorithm, tree, torus_x=None):
    mesh = data_mesh(8)

    def body(t):
        return jax.tree.map(lambda a: a[None], allreduce_mean(jax.tree.map(lambda a: a[0], t), "data", algorithm,
                                                                torus_x=torus_x))

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    return collective_stats(fn.lower(tree).compile())


F32_TREE = {k: v for k, v in stacked_tree(8).items() if k != "half"}  # 1 + 7 + 15 = 23 floats, padded to 24


@pytest.mark.parametrize("algorithm,permutes", [("ring", 14), ("ps", 14), ("torus2d", 8)])
def test_hlo_step_counts(algorithm, permutes):
    stats = compiled_stats(algorithm, F32_TREE)
    assert stats["collective-permute"]["count"] == permutes
    assert stats["all-reduce"]["count"] == 0
    assert stats["reduce-scatter"]["count"] == stats["all-gather"]["count"] == 0
    assert permutes == theoretical_traffic(algorithm, 8, 92)["steps"]
    if algorithm == "ring":  # every step sends one 1/N chunk of the padded buffer: 24 / 8 * 4 bytes
        assert stats["collective-permute"]["bytes"] == 14 * (24 // 8 * 4)
    if algorithm == "torus2d":  # X=2: 2 X-steps of 12 floats, 6 Y-steps of 3 floats
        assert stats["collective-permute"]["bytes"] == 2 * 12 * 4 + 6 * 3 * 4


def test_hlo_fusion_is_per_dtype_and_psum_is_native():
    two_dtypes = stacked_tree(8)
    assert compiled_stats("ring", two_dtypes)["collective-permute"]["count"] == 2 * 14
    psum = compiled_stats("psum", two_dtypes)
    assert psum["all-reduce"]["count"] >= 1 and psum["collective-permute"]["count"] == 0


def test_collective_stats_parses_tuples_async_and_dtypes():
    hlo = """
ENTRY %main (p: f32[4]) -> f32[4] {
  %ar = (f32[16]{0}, bf16[8]{0}) all-reduce(%a, %b), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %ags = (f32[2]{0}, f32[16]{0}) all-gather-start(%c), channel_id=2, dimensions={0}
  %agd = f32[16]{0} all-gather-done((f32[2]{0}, f32[16]{0}) %ags)
  %cps = (s32[3,2]{1,0}, s32[3,2]{1,0}, u32[], u32[]) collective-permute-start(%d), source_target_pairs={{0,1}}
  %cpd = s32[3,2]{1,0} collective-permute-done(%cps)
  %rs = pred[10]{0} reduce-scatter(%e), dimensions={0}, to_apply=%or
  ROOT %a2a = f16[2,2]{1,0} all-to-all(%f), dimensions={0}
}"""
    stats = collective_stats(hlo)
    assert stats["all-reduce"] == {"count": 1, "bytes": 16 * 4 + 8 * 2}
    assert stats["all-gather"] == {"count": 1, "bytes": 64}
    assert stats["collective-permute"] == {"count": 1, "bytes": 24}
    assert stats["reduce-scatter"] == {"count": 1, "bytes": 10}
    assert stats["all-to-all"] == {"count": 1, "bytes": 8}


def test_bad_torus_and_unknown_algorithm_raise_config_error():
    mesh = data_mesh(8)
    fn = jax.shard_map(lambda x: allreduce_mean(x, "data", "torus2d", torus_x=3), mesh=mesh,
                       in_specs=P("data"), out_specs=P("data"))
    # the library names the argument; the command line (cli_message) the flag
    with pytest.raises(OptionError, match=r"^torus_x=3: does not divide .* 8; use one of: 1, 2, 4, 8") as info:
        jax.eval_shape(fn, jnp.zeros(8))
    assert cli_message(info.value).startswith("--torus 3: does not divide the data axis size 8")
    with pytest.raises(ConfigError, match=r"^torus_x=5"):
        theoretical_traffic("torus2d", 8, 100, torus_x=5)
    with pytest.raises(OptionError, match=r"^allreduce='tree': is not one of: psum, ring, torus2d, ps$") as info:
        allreduce_mean({}, "data", "tree")
    assert cli_message(info.value) == "--allreduce 'tree': is not one of: psum, ring, torus2d, ps"
    with pytest.raises(OptionError, match=r"^torus_x=2: applies only with allreduce torus2d$") as info:
        jaxpar.Sync("ring", torus_x=2)
    assert cli_message(info.value) == "--torus 2: applies only with --allreduce torus2d"
    with pytest.raises(ConfigError, match=r"^allreduce"):
        theoretical_traffic("tree", 8, 100)


def test_default_torus_x():
    assert [default_torus_x(n) for n in range(1, 13)] == [1, 1, 1, 2, 1, 2, 1, 2, 3, 2, 1, 3]


def test_theoretical_traffic_n8():
    nbytes = 800
    ring = theoretical_traffic("ring", 8, nbytes)
    assert (ring["steps"], ring["bytes_sent_per_device"]) == (14, 1400)
    torus = theoretical_traffic("torus2d", 8, nbytes)  # X=2, Y=4: 2*1/2*800 + 2*3/8*800, the ring's bytes
    assert (torus["steps"], torus["bytes_sent_per_device"]) == (8, 800 + 600)
    assert theoretical_traffic("torus2d", 8, 128, torus_x=4)["bytes_sent_per_device"] == 2 * 3 / 4 * 128 + 2 * 1 / 8 * 128
    assert theoretical_traffic("torus2d", 8, nbytes, torus_x=4)["steps"] == 2 * 3 + 2 * 1
    ps = theoretical_traffic("ps", 8, nbytes)
    assert (ps["steps"], ps["bytes_sent_per_device"]) == (14, 7 * 800)
    psum = theoretical_traffic("psum", 8, nbytes)
    assert (psum["steps"], psum["bytes_sent_per_device"]) == (14, 1400) and "native" in psum["note"]
    assert theoretical_traffic("ring", 1, nbytes)["steps"] == 0
