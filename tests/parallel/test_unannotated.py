"""Models nobody annotated for sharding (Linen, written as Flax's examples write them) are sharded anyway: FSDP over
each parameter's largest dimension that divides, path rules for tensor parallelism; the FSDP fallback whoever wrote
the rules, `strict=True` for today's error; messages that read right whatever the names are.

Tolerances as in test_fsdp: float32, losses rtol 1e-5 (only the summation order differs).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.parallel.sharding_notes import ShardingNotes
from jaxpar.parallel import partitioning as shd


# --- small Linen models in the style of Flax's examples, without a sharding annotation -------------------------------
class ResNetBlock(nn.Module):
    filters: int
    strides: tuple = (1, 1)

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
        residual = x
        y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)))
        y = norm(scale_init=nn.initializers.zeros_init())(nn.Conv(self.filters, (3, 3), use_bias=False)(y))
        if residual.shape != y.shape:
            residual = norm(name="norm_proj")(nn.Conv(self.filters, (1, 1), self.strides, use_bias=False,
                                                     name="conv_proj")(residual))
        return nn.relu(residual + y)


class ResNet(nn.Module):
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(16, (3, 3), use_bias=False)(x)))
        x = ResNetBlock(16)(x, train)
        x = ResNetBlock(32, (2, 2))(x, train)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


class MlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.gelu(nn.Dense(self.mlp_dim)(x))
        return nn.Dense(x.shape[-1])(y)


class EncoderBlock(nn.Module):
    heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x))
        x = x + y
        return x + MlpBlock(self.mlp_dim)(nn.LayerNorm()(x))


class ViT(nn.Module):
    num_classes: int = 10
    hidden: int = 32

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.hidden, (4, 4), strides=(4, 4), padding="VALID", name="embedding")(x)
        x = x.reshape(x.shape[0], -1, self.hidden)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, self.hidden))
        x = jnp.concatenate([jnp.tile(cls, (x.shape[0], 1, 1)), x], axis=1)
        x = x + self.param("pos_embedding", nn.initializers.normal(0.02), (1, x.shape[1], self.hidden))
        for _ in range(2):
            x = EncoderBlock(heads=4, mlp_dim=64)(x)
        return nn.Dense(self.num_classes, name="head")(nn.LayerNorm()(x)[:, 0])


MODELS = {"resnet": ResNet, "vit": ViT}


def image_batch(seed: int, classes: int = 10) -> dict:
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(16, 8, 8, 3)).astype(np.float32),
            "label": rng.integers(0, classes, 16).astype(np.int32)}


def classify(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), {}


def linen_trainer(module, mesh, **kw):
    factory = jaxpar.from_linen(module, jnp.zeros((1, 8, 8, 3)), train_kwargs={"train": True},
                                eval_kwargs={"train": False})
    return jaxpar.Trainer(factory, classify, optax.adam(1e-3), jaxpar.make_mesh(mesh), **kw)


def losses(trainer, steps=2):
    state, out = trainer.init(0), []
    for step in range(steps):
        state, metrics = trainer.step(state, image_batch(step))
        out.append(float(metrics["loss"]))
    return state, out


def per_device_and_total_bytes(state):
    leaves = jax.tree.leaves((state.params, state.opt_state))
    per_device = {}
    for x in leaves:
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values()), sum(x.nbytes for x in leaves)


def specs(state):
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    return {"/".join(str(k.key) for k in path[1:] if hasattr(k, "key")): x.sharding.spec for path, x in flat}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_unannotated_linen_model_is_split_over_fsdp_and_trains_like_one_device(name):
    trainer = linen_trainer(MODELS[name](), "fsdp=8")
    state, fsdp_losses = losses(trainer)
    per_device, total = per_device_and_total_bytes(state)
    print(f"{name} fsdp=8: {per_device:,} bytes per device = {per_device / (total / 8):.3f} x total/8 "
          f"(total {total:,})")
    assert per_device <= 1.2 * total / 8
    assert all(set(shd.split_axes(spec)) <= {"fsdp"} for spec in specs(state).values())  # only ever fsdp
    notes = "\n".join(trainer.notes)
    assert "nn.with_logical_partitioning" in notes and "nnx.with_partitioning" not in notes
    assert "parameters are split over fsdp along their largest dimension" in notes
    assert "linen.head.bias.value [10]" in notes if name == "vit" else "linen.Dense_0.bias.value [10]" in notes
    _, reference = losses(linen_trainer(MODELS[name](), "1x1"))
    np.testing.assert_allclose(fsdp_losses, reference, rtol=1e-5)


def test_only_the_fsdp_axis_and_only_a_dimension_that_divides():
    mesh = jaxpar.make_mesh("data=2,fsdp=2,model=2")
    notes = ShardingNotes()
    assert shd.fsdp_anywhere((3, 8, 4), mesh, "w", notes) == P(None, "fsdp", None)  # the largest that divides
    assert shd.fsdp_anywhere((4, 4), mesh, "v", notes) == P("fsdp", None)  # a tie: the first
    assert shd.fsdp_anywhere((5,), mesh, "b", notes) == P()
    assert shd.fsdp_anywhere((), mesh, "s", notes) == P()  # a scalar: nothing to split, nothing to report
    assert notes.whole == [("b", (5,))] and notes.fsdp_auto == 2
    assert shd.fsdp_anywhere((8, 8), jaxpar.make_mesh("2x4"), "w") == P()  # no fsdp axis: whole


# --- path rules: tensor parallelism for a model nobody annotated ------------------------------------------------------
VIT_TENSOR_PARALLEL = [
    (r"MlpBlock_0/Dense_0/kernel", ("embed", "mlp")),  # logical names, mapped by the rules
    (r"MlpBlock_0/Dense_0/bias", ("mlp",)),
    (r"MlpBlock_0.Dense_1.kernel", ("mlp", "embed")),  # `.` matches the `/` too
    (r".*Attention_0/(query|key|value)/kernel", (None, "model", None)),  # [embed, heads, head_dim]: a mesh axis
    (r".*Attention_0/(query|key|value)/bias", ("heads", None)),
    (r".*Attention_0/out/kernel", ("heads", None, None)),
]


@pytest.mark.slow
def test_path_rules_make_an_unannotated_linen_model_tensor_parallel():
    trainer = linen_trainer(ViT(), "2x4", path_rules=VIT_TENSOR_PARALLEL)
    state, tp_losses = losses(trainer)
    placed = specs(state)
    for block in ("EncoderBlock_0", "EncoderBlock_1"):
        assert placed[f"{block}/MlpBlock_0/Dense_0/kernel"] == P(None, "model")
        assert placed[f"{block}/MlpBlock_0/Dense_0/bias"] == P("model")
        assert placed[f"{block}/MlpBlock_0/Dense_1/kernel"] == P("model", None)
        assert placed[f"{block}/MultiHeadDotProductAttention_0/key/kernel"] == P(None, "model", None)
        assert placed[f"{block}/MultiHeadDotProductAttention_0/query/bias"] == P("model", None)
        assert placed[f"{block}/MultiHeadDotProductAttention_0/out/kernel"] == P("model", None, None)
        assert placed[f"{block}/MlpBlock_0/Dense_1/bias"] == P()  # no rule matches: whole (no fsdp axis)
    assert state.params["linen"]["EncoderBlock_0"]["MlpBlock_0"]["Dense_0"]["kernel"].addressable_shards[
        0].data.shape == (32, 16)
    assert trainer.notes == []
    _, reference = losses(linen_trainer(ViT(), "1x1"))
    np.testing.assert_allclose(tp_losses, reference, rtol=1e-5)


def test_path_rules_over_an_nnx_model_see_its_attribute_paths_and_override_its_names():
    from tests.helpers import trainer_for  # the built-in MLP: hidden.kernel is annotated ("embed", "mlp")

    trainer = trainer_for("mlp", "2x4", path_rules=[(r"^hidden/kernel$", ("mlp", None))])
    assert trainer.state_shardings.params["hidden"]["kernel"].spec == P("model", None)
    assert trainer.state_shardings.params["out"]["kernel"].spec == P("model", None)  # its own names, unmatched


class MlpClassifier(nn.Module):
    """ViT's MlpBlock alone, on flattened images: MlpBlock_0/Dense_0/kernel [192, 64], Dense_1 [64, 192]."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        return nn.Dense(10, name="head")(MlpBlock(64)(x.reshape(x.shape[0], -1)))


@pytest.mark.slow
def test_a_path_rules_parameter_keeps_only_the_rules_placement_and_naming_fsdp_gives_both():
    """docs/library.md and docs/mesh-and-sharding.md, "Only the rule's placement", on data=2,fsdp=2,model=2."""
    only_model = linen_trainer(MlpClassifier(), "data=2,fsdp=2,model=2",
                               path_rules=[(r"MlpBlock_\d+/Dense_0/kernel", (None, "model"))])
    state = only_model.init(0)
    placed = specs(state)
    assert placed["MlpBlock_0/Dense_0/kernel"] == P(None, "model")  # no automatic fsdp split added
    kernel = state.params["linen"]["MlpBlock_0"]["Dense_0"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(192, 32)}
    assert placed["MlpBlock_0/Dense_1/kernel"] == P(None, "fsdp")  # unmatched, unnamed: the automatic split
    both = linen_trainer(MlpClassifier(), "data=2,fsdp=2,model=2",
                         path_rules=[(r"MlpBlock_\d+/Dense_0/kernel", ("fsdp", "model")),
                                     (r"MlpBlock_\d+/Dense_1/kernel", ("mlp", "embed"))])
    state, both_losses = losses(both)
    placed = specs(state)
    assert placed["MlpBlock_0/Dense_0/kernel"] == P("fsdp", "model")
    assert placed["MlpBlock_0/Dense_1/kernel"] == P("model", "fsdp")  # DEFAULT_RULES: mlp -> model, embed -> fsdp
    kernel = state.params["linen"]["MlpBlock_0"]["Dense_0"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(96, 32)}
    _, reference = losses(linen_trainer(MlpClassifier(), "1x1"))
    np.testing.assert_allclose(both_losses, reference, rtol=1e-5)


class SevenClasses(nn.Module):
    """An annotated Linen classifier whose 7-class output dimension is named `embed` (fsdp under the defaults)."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        init = nn.initializers.lecun_normal()
        x = nn.relu(nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(
            x.reshape(x.shape[0], -1)))
        return nn.Dense(7, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(x)


@pytest.mark.slow
def test_fsdp_fallback_applies_whoever_wrote_the_rules_and_strict_restores_the_error():
    trainer = linen_trainer(SevenClasses(), "fsdp=2", rules=jaxpar.DEFAULT_RULES)
    assert specs(trainer.init(0))["Dense_1/kernel"] == P("fsdp", None)  # the 16 rows instead of the 7 classes
    assert any("linen.Dense_1.kernel.value [16, 7] on dim 0" in note for note in trainer.notes)
    _, fallback = losses(trainer, steps=1)
    _, reference = losses(linen_trainer(SevenClasses(), "1x1"), steps=1)
    np.testing.assert_allclose(fallback, reference, rtol=1e-5)
    with pytest.raises(jaxpar.ShardingError) as info:
        linen_trainer(SevenClasses(), "fsdp=2", rules=jaxpar.DEFAULT_RULES, strict=True)
    assert str(info.value) == (
        "parameter linen.Dense_1.kernel.value of shape (16, 7): dimension 1 (logical 'embed') = 7 is not divisible "
        "by mesh axis 'fsdp' of size 2; make that dimension a multiple of 2, use a smaller fsdp axis, or map 'embed' "
        "to None in the rules")


def test_a_model_axis_placement_that_does_not_divide_is_still_an_error():
    with pytest.raises(jaxpar.ShardingError) as info:
        linen_trainer(SevenClasses(), "2x4", path_rules=[(r"Dense_1/kernel", (None, "model"))])
    assert str(info.value) == (
        "parameter linen.Dense_1.kernel.value of shape (16, 7): dimension 1 (path rule 'Dense_1/kernel') = 7 is not "
        "divisible by mesh axis 'model' of size 4; make that dimension a multiple of 4, use a smaller model axis, or "
        "change the path rule")
    with pytest.raises(jaxpar.ShardingError, match=r"^parameter linen.Dense_1.kernel.value of shape \(16, 7\): "
                                                   r"dimension 1 \(logical 'vocab', from path rule 'Dense_1/k'\) = 7 "):
        linen_trainer(SevenClasses(), "2x4", path_rules=[(r"Dense_1/k", ("embed", "vocab"))])


def test_path_rule_of_another_rank_or_malformed_is_an_error_naming_the_parameter():
    with pytest.raises(jaxpar.ShardingError) as info:
        linen_trainer(SevenClasses(), "fsdp=2", path_rules=[(r"Dense_0/kernel", ("embed",))])
    assert str(info.value).startswith("parameter linen.Dense_0.kernel.value of shape (192, 16): path rule "
                                      "'Dense_0/kernel' -> ('embed',) gives 1 dimension(s) for a parameter of rank 2")
    with pytest.raises(jaxpar.ShardingError, match=r"^path_rules: '\(' is not a regular expression"):
        linen_trainer(SevenClasses(), "fsdp=2", path_rules=[("(", (None,))])
    with pytest.raises(jaxpar.ShardingError, match=r"^path_rules: \('embed', 'fsdp'\) is not a \(regex, tuple of "
                                                   r"names\) pair"):
        linen_trainer(SevenClasses(), "fsdp=2", path_rules=[("embed", "fsdp")])  # Flax's logical rules, misplaced


def test_divisibility_message_reads_right_with_bonsai_style_names():
    # jax-ml/bonsai names dimensions after mesh axes (`fsdp`, `tp`); rules map them onto jaxpar's axes
    def model(rngs):
        return nnx.Linear(8, 2, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", "tp")),
                          rngs=rngs)

    with pytest.raises(jaxpar.ShardingError) as info:
        jaxpar.Trainer(model, lambda m, b: (m(b["x"]).sum(), {}), optax.sgd(0.1), jaxpar.make_mesh("2x4"),
                       rules={"fsdp": "fsdp", "tp": "model"})
    assert str(info.value) == (
        "parameter kernel.value of shape (8, 2): dimension 1 (logical 'tp') = 2 is not divisible by mesh axis 'model' "
        "of size 4; make that dimension a multiple of 4, use a smaller model axis, or map 'tp' to None in the rules")
