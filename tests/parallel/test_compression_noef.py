"""Codecs without error feedback (`int8:noef`, `powersgd:R:noef`, for the convergence study): parsed, stateless
(the quantisation error is dropped every step, no residual is kept), trained, and refused in one line for the
codecs that keep no residual."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxpar
import run
from jaxpar.parallel import compression as cz
from tests.parallel.test_compression import N, REPLICA_AXIS, exchange, losses, per_replica
from tests.helpers import trainer_for


def test_noef_names_parse_to_the_codec_without_error_feedback():
    for value, cls, rank in (("int8:noef", cz.Int8, None), ("powersgd:4:noef", cz.PowerSGD, 4)):
        codec = cz.parse_codec(value)
        assert isinstance(codec, cls) and codec.error_feedback is False and codec.name == value
        assert getattr(codec, "rank", None) == rank
    assert cz.parse_codec("int8").error_feedback and cz.parse_codec("powersgd:4").error_feedback


@pytest.mark.parametrize("value,message", [
    ("bf16:noef", "--compress 'bf16:noef': bf16 keeps no residual, so it has no :noef variant; use bf16, int8:noef "
                  "or powersgd:R:noef"),
    ("powersgd:noef", "--compress 'powersgd:noef': powersgd needs a rank R >= 1 after the colon, e.g. "
                      "powersgd:4:noef"),
    ("int8:ef", "--compress 'int8:ef': is not one of: none, bf16, fp16, int8, powersgd:R (int8 and powersgd:R also "
                "as int8:noef, powersgd:R:noef: without error feedback)"),
])
def test_bad_noef_values_are_one_line(value, message, capsys):
    assert run.main(["--model", "mlp", "--mesh", "8", "--steps", "1", "--allreduce", "psum", "--compress",
                     value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(message) and "\n" not in err and "Traceback" not in err
    with pytest.raises(jaxpar.JaxparError):
        jaxpar.Sync(allreduce="psum", compress=value)


def test_int8_noef_sends_the_quantised_gradient_and_keeps_no_residual():
    rng = np.random.default_rng(5)
    g = rng.normal(size=(N, 300)).astype(np.float32)
    noef, ef = cz.Int8(error_feedback=False), cz.Int8()

    def one(x, r):
        (a,), own, _ = noef.mean([x], [], (), exchange("ring"), N, REPLICA_AXIS)
        assert own == []  # nothing kept
        (b,), (_, new), _ = ef.mean([x], [jnp.zeros_like(r), r], (), exchange("ring"), N, REPLICA_AXIS)
        return a, b, new

    a, b, new = (np.asarray(t) for t in per_replica(one)(g, 0.05 * g))
    # two quantizations (each replica's gradient, then the owner's mean), each within half a step of 256 elements
    assert np.abs(a - g.mean(0)).max() < 0.05 and (a == a[0]).all()
    assert np.abs(a - b).max() > 1e-3  # error feedback adds the old residual; noef does not
    assert np.abs(new).max() > 0


def test_powersgd_noef_is_the_rank_r_approximation_of_the_gradient_alone():
    g = np.random.default_rng(6).normal(size=(N, 12, 9)).astype(np.float32)
    q0 = jax.random.normal(jax.random.key(0), (9, 2))
    codec = cz.PowerSGD(2, error_feedback=False)
    mean = np.asarray(per_replica(lambda x: codec.mean([x], [], {"0": q0}, exchange(), N, REPLICA_AXIS)[0][0])(g))
    p_hat, _ = np.linalg.qr(g.mean(0) @ np.asarray(q0))
    want = p_hat @ (g.mean(0).T @ p_hat).T
    np.testing.assert_allclose(mean, np.broadcast_to(want, mean.shape), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("codec", ["int8:noef", "powersgd:2:noef"])
@pytest.mark.slow
def test_a_noef_sync_run_trains_without_residual_state_and_differs_from_error_feedback(codec):
    state, got = losses(trainer_for("mlp", "8", strategy=jaxpar.Sync(allreduce="psum", compress=codec)))
    _, with_ef = losses(trainer_for("mlp", "8", strategy=jaxpar.Sync(allreduce="psum",
                                                                     compress=codec.removesuffix(":noef"))))
    assert got[-1] < got[0] - 0.2, got
    assert jax.tree.leaves(state.comm_state[cz.OWN]) == []  # no residuals in the train state
    assert got[0] == with_ef[0] and got[1:] != with_ef[1:]  # the same first step; then the residual matters
