"""FSDP (ZeRO-3) over the fsdp axis: per-device bytes, placement fallbacks, collectives, equivalence.

Tolerances as in test_equivalence: float32, losses rtol 1e-5, parameters atol 2e-5 (different summation order).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
import models
from jaxpar.cli import Config
from jaxpar.cost.hlo import collective_stats
from tests.helpers import batch_for, trainer_for


def per_device_and_total_bytes(state):
    leaves = jax.tree.leaves((state.params, state.opt_state))
    total = sum(x.nbytes for x in leaves)
    per_device = {}
    for x in leaves:
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values()), total


@pytest.mark.slow
@pytest.mark.parametrize("mesh, parameter_ways", [("fsdp=8", 8), ("data=2,fsdp=2,model=2", 4)])
def test_default_transformer_params_and_adam_state_are_split_over_fsdp_and_model(mesh, parameter_ways):
    config = Config()  # the default transformer, as `python run.py` trains it
    trainer = jaxpar.Trainer(models.factory(config), models.loss_for(config), optax.adamw(1e-3),
                             jaxpar.make_mesh(mesh))
    per_device, total = per_device_and_total_bytes(trainer.init(0))
    n_params = sum(x.size for x in jax.tree.leaves(trainer.init(0).params))
    assert n_params == 590_464 and 12 * n_params <= total <= 12 * n_params + 16  # params + Adam's 2 moments + counters
    assert per_device <= 1.15 * total / parameter_ways, (per_device, total / parameter_ways)
    print(f"{mesh}: {per_device:,} bytes per device = {per_device / (total / parameter_ways):.4f} x total/"
          f"{parameter_ways} (total {total:,})")


@pytest.mark.slow
def test_sync_step_all_gathers_fsdp_parameters():
    trainer = trainer_for("transformer", "fsdp=8")
    state = trainer.init(0)
    kernel = state.params["blocks"]["layers"]["up"]["kernel"]  # [layers, embed, mlp]
    assert kernel.sharding.spec == P(None, "fsdp", None) and kernel.addressable_shards[0].data.shape == (1, 4, 64)
    compiled = trainer._steps["sync"].lower(state, trainer.shard_batch(batch_for("transformer")), {}).compile()
    stats = collective_stats(compiled)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    # ZeRO-3: each parameter gathered once (XLA keeps it for the backward pass), the gradient reduced once; no
    # activations moved (without the step's layout constraint the partitioner moved 12-24x these bytes)
    assert 0.9 * param_bytes <= stats["all-gather"]["bytes"] <= 1.05 * param_bytes
    assert stats["all-reduce"]["bytes"] <= param_bytes + 64
    assert stats["all-to-all"]["bytes"] + stats["collective-permute"]["bytes"] < 0.05 * param_bytes


class Classifier(nnx.Module):
    """An output layer of `classes` whose class dimension is (oddly) named `embed`, with a bias of that size."""

    def __init__(self, classes, rngs):
        init = nnx.initializers.lecun_normal()
        self.hidden = nnx.Linear(16, 32, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                                 bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",)))
        self.out = nnx.Linear(32, classes, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
                              bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed",)))

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


def classifier_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def classifier_batch(classes, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(16, 16)).astype(np.float32), "y": rng.integers(0, classes, 16).astype(np.int32)}


@pytest.mark.parametrize("classes", [7, 10])
def test_fsdp_dimension_that_does_not_divide_moves_or_stays_whole_and_is_reported(classes):
    trainer = jaxpar.Trainer(lambda rngs: Classifier(classes, rngs), classifier_loss, optax.sgd(0.1),
                             jaxpar.make_mesh("fsdp=4"))
    state = trainer.init(0)
    assert state.params["out"]["kernel"].sharding.spec == P("fsdp", None)  # 32 hidden rows split instead
    assert all(entry is None for entry in state.params["out"]["bias"].sharding.spec)  # nothing divides by 4: whole
    assert state.params["hidden"]["kernel"].sharding.spec == P("fsdp", None)
    notes = "\n".join(trainer.notes)
    assert f"1 parameter(s) stay whole" in notes and f"out.bias.value [{classes}]" in notes
    assert f"out.kernel.value [32, {classes}] on dim 0" in notes
    # it trains exactly like one device
    reference = jaxpar.Trainer(lambda rngs: Classifier(classes, rngs), classifier_loss, optax.sgd(0.1),
                               jaxpar.make_mesh("1x1"))
    ref_state = reference.init(0)
    for step in range(3):
        state, metrics = trainer.step(state, classifier_batch(classes, step))
        ref_state, ref_metrics = reference.step(ref_state, classifier_batch(classes, step))
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), trainer.params(state),
                 reference.params(ref_state))


def test_fsdp_fallback_joins_a_tensor_parallel_dimension_when_no_free_one_divides():
    trainer = jaxpar.Trainer(lambda rngs: Classifier(7, rngs), classifier_loss, optax.sgd(0.1),
                             jaxpar.make_mesh("data=2,fsdp=2,model=2"))
    state = trainer.init(0)
    kernel = state.params["out"]["kernel"]
    assert kernel.sharding.spec == P(("model", "fsdp"), None)
    assert kernel.addressable_shards[0].data.shape == (8, 7)


def test_explicit_rules_fall_back_too_and_strict_makes_it_an_error():
    mesh = jaxpar.make_mesh("fsdp=4")
    given = jaxpar.Trainer(lambda rngs: Classifier(10, rngs), classifier_loss, optax.sgd(0.1), mesh,
                           rules=dict(jaxpar.DEFAULT_RULES))
    assert given.init(0).params["out"]["kernel"].sharding.spec == P("fsdp", None)  # as with rules=None
    with pytest.raises(jaxpar.ShardingError, match=r"^parameter out\.(bias|kernel)\.value of shape \((32, 10|10,)\): "
                                                   r"dimension \d \(logical 'embed'\) = 10 is not divisible by mesh "
                                                   r"axis 'fsdp' of size 4"):
        jaxpar.Trainer(lambda rngs: Classifier(10, rngs), classifier_loss, optax.sgd(0.1), mesh,
                       rules=dict(jaxpar.DEFAULT_RULES), strict=True)


def test_a_model_without_names_is_split_over_fsdp_and_the_note_names_the_nnx_api():
    trainer = trainer_for("cnn", "fsdp=8")  # the CNN names only its channels (mlp), nothing over fsdp
    assert all("names no parameter dimensions" not in n for n in trainer.notes)

    def unannotated(mesh, **kw):
        return jaxpar.Trainer(lambda rngs: nnx.Linear(16, 8, rngs=rngs), lambda m, b: (m(b["x"]).sum(), {}),
                              optax.sgd(0.1), jaxpar.make_mesh(mesh), **kw)

    split = unannotated("fsdp=8")
    state = split.init(0)
    assert state.params["kernel"].sharding.spec == P("fsdp", None) and state.params["bias"].sharding.spec == P("fsdp")
    assert split.notes == ["the model names no parameter dimensions, so 2 of its 2 parameters are split over fsdp "
                           "along their largest dimension that divides by 8; to choose the split (or for tensor "
                           "parallelism), name their dimensions with nnx.with_partitioning, or pass path_rules"]
    # nothing can be split: model axis only, or strict (no automatic placement)
    for mesh, kw in (("2x4", {}), ("fsdp=8", {"strict": True})):
        assert any("every parameter is replicated on all 8 devices" in n and "nnx.with_partitioning" in n
                   for n in unannotated(mesh, **kw).notes)
    assert unannotated("8").notes == []  # pure data parallel: nothing to say
