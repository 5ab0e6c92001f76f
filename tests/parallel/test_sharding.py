import math

import jax
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.parallel.partitioning import DEFAULT_RULES, spec_for
from tests.helpers import trainer_for

# parameter path -> expected PartitionSpec under the default rules on a 2x4 mesh
EXPECTED = {
    "transformer": {"token_embed/embedding": P("model", None),
                    "blocks/layers/attn/q/kernel": P(None, None, "model", None),
                    "blocks/layers/attn/k/kernel": P(None, None, "model", None),
                    "blocks/layers/attn/v/kernel": P(None, None, "model", None),
                    "blocks/layers/attn/out/kernel": P(None, "model", None, None),
                    "blocks/layers/gate/kernel": P(None, None, "model"), "blocks/layers/up/kernel": P(None, None, "model"),
                    "blocks/layers/down/kernel": P(None, "model", None), "blocks/layers/attn_norm/scale": P(None, None),
                    "norm/scale": P(None), "head/kernel": P(None, "model")},
    "mlp": {"hidden/kernel": P(None, "model"), "hidden/bias": P("model"), "out/kernel": P("model", None),
            "out/bias": P(None)},
    "cnn": {"conv1/kernel": P(None, None, None, "model"), "conv1/bias": P("model"), "bn1/scale": P("model"),
            "conv2/kernel": P(None, None, "model", None), "out/kernel": P(None, None)},
}


def flat_params(state):
    leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
    return {"/".join(str(k.key) for k in path if hasattr(k, "key")): leaf for path, leaf in leaves}


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_parameter_shardings_follow_the_rules(model):
    trainer = trainer_for(model, "2x4")
    params = flat_params(trainer.init(0))
    for name, spec in EXPECTED[model].items():
        array = params[name]
        assert array.sharding.spec == spec or P(*spec, *[None] * (array.ndim - len(spec))) == array.sharding.spec, name
        sharded_dims = [d for d, axis in enumerate(array.sharding.spec) if axis == "model"]
        shard = array.addressable_shards[0].data
        if sharded_dims:  # a tensor-parallel parameter: each device holds exactly a quarter of it
            assert shard.size * 4 == array.size, name
            assert shard.shape[sharded_dims[0]] * 4 == array.shape[sharded_dims[0]]
        else:
            assert shard.shape == array.shape


def test_optimizer_state_is_sharded_like_params():
    import optax
    state = trainer_for("mlp", "2x4", optimizer=optax.adam(1e-3)).init(0)
    mu = state.opt_state[0].mu
    assert mu["hidden"]["kernel"].sharding.spec == P(None, "model")
    assert mu["hidden"]["kernel"].addressable_shards[0].data.shape == (64, 8)
    assert state.opt_state[0].count.sharding.spec == P()


def test_rule_naming_a_missing_mesh_axis_is_a_clear_error():
    with pytest.raises(jaxpar.ShardingError, match=r"rule 'mlp' -> 'tensor' names a mesh axis that does not exist"):
        trainer_for("mlp", "2x4", rules={**DEFAULT_RULES, "mlp": "tensor"})


def test_two_dimensions_on_one_mesh_axis_names_the_parameter():
    with pytest.raises(jaxpar.ShardingError, match=r"parameter hidden\.kernel\.value of shape \(64, 32\): "
                                                   r"dimensions 0 \('embed'\) and 1 \('mlp'\)"):
        trainer_for("mlp", "2x4", rules={**DEFAULT_RULES, "embed": "model"})


def test_dimension_not_divisible_by_model_axis_names_dimension_value_and_axis_size():
    # TINY transformer has 8 heads and d_ff 64: a 1x3 mesh cannot split them
    with pytest.raises(jaxpar.ShardingError, match=r"^parameter \S+ of shape \([\d, ]+\): dimension \d \(logical "
                                                   r"'(heads|mlp|vocab)'\) = \d+ is not divisible by mesh axis 'model' "
                                                   r"of size 3; make that dimension a multiple of 3"):
        trainer_for("transformer", "1x3")


def test_unnamed_and_unruled_dimensions_are_replicated():
    mesh = jaxpar.make_mesh("2x4")
    assert spec_for(("embed", "unknown", None), DEFAULT_RULES, mesh, "x", (4, 4, 4)) == P(None, None, None)
    assert spec_for(None, DEFAULT_RULES, mesh, "x") == P()
    assert math.prod(mesh.devices.shape) == 8


# Flax's lm1b example rules, with its mesh-axis names translated to jaxpar's ("tensor" -> "model").
LM1B_RULES = [("activation_batch", ("data", "fsdp")), ("activation_length", None), ("activation_embed", "model"),
              ("activation_mlp", "model"), ("activation_heads", "model"), ("activation_kv", None),
              ("activation_vocab", "model"), ("mlp", "model"), ("vocab", "model"), ("embed", "fsdp"),
              ("heads", "model"), ("kv", None)]


def test_flax_list_rules_take_the_first_rule_whose_mesh_axis_is_still_free():
    mesh = jaxpar.make_mesh("data=2,fsdp=2,model=2")
    rules = [("embed", "fsdp"), ("embed", "model"), ("mlp", "model")]
    assert spec_for(("embed", "mlp"), rules, mesh, "x", (4, 4)) == P("fsdp", "model")
    assert spec_for(("embed", "embed"), rules, mesh, "x", (4, 4)) == P("fsdp", "model")  # second: next free rule
    assert spec_for(("mlp", "embed", "embed"), rules, mesh, "x", (4, 4, 4)) == P("model", "fsdp", None)  # none free
    with pytest.raises(jaxpar.ShardingError, match=r"dimensions 0 \('embed'\) and 1 \('embed'\) both map to mesh "
                                                   r"axis 'fsdp'"):
        spec_for(("embed", "embed"), {"embed": "fsdp"}, mesh, "x", (4, 4))  # a dict keeps its strict meaning


@pytest.mark.slow
def test_lm1b_rules_work_unchanged_in_form_and_train_like_the_defaults():
    import numpy as np
    losses = {}
    for rules in (None, LM1B_RULES):
        trainer = trainer_for("transformer", "data=2,fsdp=2,model=2", rules=rules)
        state = trainer.init(0)
        assert state.params["blocks"]["layers"]["attn"]["q"]["kernel"].sharding.spec == P(None, "fsdp", "model", None)
        assert state.params["token_embed"]["embedding"].sharding.spec == P("model", "fsdp")
        from tests.helpers import batch_for
        state, metrics = trainer.step(state, batch_for("transformer"))
        losses[rules is None] = float(metrics["loss"])
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-6)


def test_names_no_rule_mentions_are_reported_once():
    typo = {**DEFAULT_RULES, "mlp": None}
    del typo["mlp"]
    trainer = trainer_for("mlp", "2x4", rules={**typo, "mpl": "model"})
    notes = trainer.notes
    assert len([n for n in notes if "appear in the model but in no sharding rule" in n]) == 1
    assert "logical axis names mlp appear" in notes[0]
    assert trainer.init(0).params["hidden"]["kernel"].sharding.spec == P(None, None)  # replicated, as it says
    assert trainer_for("mlp", "2x4").notes == []


def test_partitioning_derives_specs_by_role():
    """The specs other modules use are built here by role: inside a replica (every axis but data kept), ZeRO-3's
    gathered layout (fsdp dropped), stacks over the replicas or unsplit, and the batch over data x fsdp."""
    from jaxpar.parallel import partitioning as shd

    mesh = jaxpar.make_mesh("data=2,fsdp=2,model=2")
    stored = jax.sharding.NamedSharding(mesh, P("data", ("fsdp", "model"), None))
    assert shd.within_replica_specs(stored) == P(None, ("fsdp", "model"), None)
    assert shd.gathered_over(stored, "fsdp").spec == P("data", "model", None)
    param = jax.sharding.NamedSharding(mesh, P(("fsdp", "model"), None))
    assert shd.stacked(param).spec == P("data", ("fsdp", "model"), None)
    assert shd.stacked(param, over_replicas=False).spec == P(None, ("fsdp", "model"), None)
    assert shd.batch_sharding(mesh).spec == P(("data", "fsdp"))
    assert shd.split_axes(stored.spec) == {"data", "fsdp", "model"}
