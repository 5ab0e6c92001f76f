"""The built-in transformer (issue 19): Llama-style blocks (RMSNorm, rotary positions, SwiGLU, no biases) stacked
in one `jaxpar.pipeline.Stack`; the stacked model trains exactly as the unstacked loop over the same blocks; the
unstacked model of before (the `gpt` block) converts to the stacked layout, parameters and checkpoints.

Tolerances: float32; per-step losses rtol 1e-5, parameters atol 2e-5, one block against numpy atol 1e-5."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
import models
from jaxpar.cli import Config
from jaxpar.io.checkpoint import Checkpointer
from jaxpar.pipeline import Pipeline
from models import convert
from models.layers import dense, layer_norm, rms_norm
from models.transformer import BLOCKS, GPT, LLAMA, Transformer, rope

SMALL = dict(vocab=64, seq_len=16, d_model=32, heads=4, d_ff=64)
RTOL, ATOL = 1e-5, 2e-5


def build(block=LLAMA, layers=3, dropout=0.0, seed=0, **sizes):
    with nnx.use_eager_sharding(False):  # outside a mesh: plain arrays
        return Transformer(**{**SMALL, **sizes}, layers=layers, dropout=dropout, block=block, rngs=nnx.Rngs(seed))


def tokens(seed=0, size=16, length=SMALL["seq_len"] + 1):
    return {"tokens": np.random.default_rng(seed).integers(0, SMALL["vocab"], (size, length)).astype(np.int32)}


def config(block=LLAMA, layers=3, dropout=0.0):
    return Config(model="transformer", block=block, layers=layers, dropout=dropout, **SMALL)


def trainer_for(mesh, block=LLAMA, layers=3, dropout=0.0, optimizer=None, pipeline=None, model=None):
    c = config(block, layers, dropout)
    return jaxpar.Trainer(model=model or models.factory(c), loss_fn=models.loss_for(c),
                          optimizer=optimizer or optax.adam(1e-2), mesh=jaxpar.make_mesh(mesh), pipeline=pipeline)


def train(trainer, steps=3, state=None):
    state = trainer.init(0) if state is None else state
    losses = []
    for step in range(steps):
        state, metrics = trainer.step(state, tokens(step))
        losses.append(float(metrics["loss"]))
    return state, np.array(losses)


# --- the stack ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", BLOCKS)
def test_block_parameters_have_a_leading_layers_dimension_named_layers(block):
    model = build(block, layers=3)
    blocks = nnx.to_flat_state(nnx.state(model.blocks, nnx.Param))
    assert blocks
    for path, variable in blocks:
        names = variable.get_metadata()["out_sharding"]
        assert variable.shape[0] == 3 and names[0] == "layers" and len(names) == variable.ndim, path
    others = nnx.to_flat_state(nnx.state(model, nnx.Param))
    assert all("layers" not in v.get_metadata()["out_sharding"] for p, v in others if p[0] != "blocks")
    assert not jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param)))  # no RNG streams: dropout takes call-time rngs


def test_the_llama_block_has_no_biases_and_no_position_table():
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(build(LLAMA), nnx.Param))}
    assert not [n for n in names if "bias" in n or "pos" in n]
    assert {"blocks.layers.attn.q.kernel", "blocks.layers.attn_norm.scale", "blocks.layers.gate.kernel",
            "blocks.layers.up.kernel", "blocks.layers.down.kernel", "norm.scale", "head.kernel"} <= names


def _reference(model, block):
    """The unstacked loop over the stacked model's blocks: (parameters, forward(parameters, tokens) -> logits), each
    layer's parameters its own arrays (slices of the stack), each block its own module (nnx.merge of the slice)."""
    block_def, stacked = nnx.split(model.blocks.layers, nnx.Param)
    parts = ("token_embed", "norm", "head") + (("pos_embed",) if block == GPT else ())
    defs = {name: nnx.graphdef(getattr(model, name)) for name in parts}
    params = {name: nnx.state(getattr(model, name), nnx.Param) for name in parts}
    params["layers"] = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(model.blocks.num_layers)]

    def forward(params, tokens_BxL):
        x = nnx.merge(defs["token_embed"], params["token_embed"])(tokens_BxL)
        if block == GPT:
            x = x + nnx.merge(defs["pos_embed"], params["pos_embed"])(jnp.arange(tokens_BxL.shape[1]))[None]
        for layer in params["layers"]:
            x = nnx.merge(block_def, layer)(x)
        return nnx.merge(defs["head"], params["head"])(nnx.merge(defs["norm"], params["norm"])(x))

    return params, forward


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.slow
def test_stacked_losses_equal_the_unstacked_loop_over_the_same_blocks(block):
    # SGD: Adam's normalised step turns last-bit differences of a near-zero gradient into lr-sized ones
    tx = optax.sgd(0.5)
    trainer = trainer_for("1x1", block, optimizer=tx)
    state, losses = train(trainer)

    model = build(block)  # the same seed's initial parameters, as the trainer made them
    initial = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(initial, trainer.params(trainer.init(0)))
    nnx.update(model, initial)
    params, forward = _reference(model, block)

    @jax.jit
    def step(params, opt_state, batch):
        def loss(p):
            logits = forward(p, batch["tokens"][:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state, expected = tx.init(params), []
    for i in range(3):
        params, opt_state, value = step(params, opt_state, tokens(i))
        expected.append(float(value))
    np.testing.assert_allclose(losses, expected, rtol=RTOL)
    trained = trainer.params(state)["blocks"]["layers"]
    for i, layer in enumerate(params["layers"]):
        jax.tree.map(lambda a, b, i=i: np.testing.assert_allclose(a[i], b, atol=ATOL), trained,
                     nnx.to_pure_dict(layer))


# --- the llama block's parts --------------------------------------------------------------------------------------
def numpy_rope(x_LxK, positions, base=10_000.0):
    """Rotary embedding as complex numbers: channel pair (i, i + K/2) times exp(1j * position * base^(-2i/K))."""
    half = x_LxK.shape[-1] // 2
    pairs = x_LxK[:, :half] + 1j * x_LxK[:, half:]
    rotated = pairs * np.exp(1j * positions[:, None] * base ** (-np.arange(half) / half)[None])
    return np.concatenate([rotated.real, rotated.imag], -1)


def test_rope_equals_the_complex_rotation_and_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 16, 2, 8)).astype(np.float32)
    positions = np.arange(16)
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(positions)))
    for head in range(2):
        np.testing.assert_allclose(got[0, :, head], numpy_rope(x[0, :, head].astype(np.float64), positions),
                                   atol=1e-5)
    q, k = rng.normal(size=(1, 1, 1, 8)).astype(np.float32), rng.normal(size=(1, 1, 1, 8)).astype(np.float32)

    def score(m, n):
        return float(jnp.sum(rope(q, jnp.array([m])) * rope(k, jnp.array([n]))))

    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-5) == pytest.approx(score(3, 0), abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)  # and they do depend on it


def test_rms_norm_matches_its_formula():
    with nnx.use_eager_sharding(False):
        norm = rms_norm(8, "embed", nnx.Rngs(0))
    norm.scale[...] = jnp.linspace(0.5, 2.0, 8)
    x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    expected = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * np.linspace(0.5, 2.0, 8)
    np.testing.assert_allclose(norm(jnp.asarray(x)), expected, atol=1e-5)


def _numpy_llama_block(p, x):
    """One Llama block in numpy (float64): RMSNorm, rotary q/k, causal attention, SwiGLU, two residuals."""
    def norm(x, scale):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * scale

    def silu(v):
        return v / (1 + np.exp(-v))

    h = norm(x, p["attn_norm"]["scale"])
    q, k, v = (np.einsum("bld,dhk->blhk", h, p["attn"][n]["kernel"]) for n in "qkv")
    length, positions = x.shape[1], np.arange(x.shape[1])
    q = np.stack([np.stack([numpy_rope(q[b, :, i], positions) for i in range(q.shape[2])], 1)
                  for b in range(q.shape[0])])
    k = np.stack([np.stack([numpy_rope(k[b, :, i], positions) for i in range(k.shape[2])], 1)
                  for b in range(k.shape[0])])
    scores = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x = x + np.einsum("blhk,hkd->bld", np.einsum("bhqs,bshk->bqhk", probs, v), p["attn"]["out"]["kernel"])
    h = norm(x, p["mlp_norm"]["scale"])
    return x + (silu(h @ p["gate"]["kernel"]) * (h @ p["up"]["kernel"])) @ p["down"]["kernel"]


@pytest.mark.slow
def test_one_llama_block_matches_numpy_rmsnorm_rope_attention_and_swiglu():
    model = build(LLAMA, layers=2)
    block_def, stacked = nnx.split(model.blocks.layers, nnx.Param)
    layer = jax.tree.map(lambda a: a[1], stacked)
    # scales away from 1, so RMSNorm's scale is exercised
    scales = nnx.to_pure_dict(layer)
    for name in ("attn_norm", "mlp_norm"):
        scales[name]["scale"] = np.linspace(0.5, 1.5, SMALL["d_model"]).astype(np.float32)
    nnx.replace_by_pure_dict(layer, scales)
    x = np.random.default_rng(2).normal(size=(2, 8, SMALL["d_model"])).astype(np.float32)
    got = nnx.merge(block_def, layer)(jnp.asarray(x))
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(layer))
    np.testing.assert_allclose(got, _numpy_llama_block(p, x.astype(np.float64)), atol=1e-5)


@pytest.mark.parametrize("block", BLOCKS)
def test_attention_is_causal(block):
    model = build(block, layers=2)
    batch = tokens(0, size=2, length=16)["tokens"]
    changed = batch.copy()
    changed[:, 9] = (changed[:, 9] + 1) % SMALL["vocab"]
    before, after = np.asarray(model(jnp.asarray(batch))), np.asarray(model(jnp.asarray(changed)))
    np.testing.assert_array_equal(before[:, :9], after[:, :9])  # earlier positions never see a later token
    assert not np.allclose(before[:, 9:], after[:, 9:])


def test_an_odd_head_width_is_refused_for_rotary_positions():
    with pytest.raises(jaxpar.ConfigError, match="head width d_model / heads = 9 must be even"):
        build(LLAMA, d_model=36, heads=4)
    build(GPT, d_model=36, heads=4)  # learned positions: any width


# --- dropout: call-time rngs ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_dropout_draws_from_call_time_rngs_and_follows_the_seed_on_every_mesh():
    _, reference = train(trainer_for("1x1", dropout=0.1))
    _, again = train(trainer_for("1x1", dropout=0.1))
    np.testing.assert_array_equal(reference, again)
    _, off = train(trainer_for("1x1", dropout=0.0))
    assert not np.allclose(reference, off, rtol=1e-3)  # dropout does act
    _, losses = train(trainer_for("2x4", dropout=0.1))
    np.testing.assert_allclose(losses, reference, rtol=RTOL, err_msg="2x4")


@pytest.mark.slow
def test_dropout_on_a_stage_mesh_equals_1x1_with_the_same_microbatches():
    """On data=2,stage=2,model=2 the vocabulary is tensor-parallel: 1F1B's head on the last stage once crashed XLA's
    SPMD partitioner there (jaxpar.pipeline.split._head_inputs). GPipe with dropout on this model: the seq meshes'
    pipelines (tests/parallel/test_seq_equivalence.py)."""
    _, reference = train(trainer_for("1x1", layers=4, dropout=0.1, pipeline=Pipeline(microbatches=2)))
    _, losses = train(trainer_for("data=2,stage=2,model=2", layers=4, dropout=0.1,
                                  pipeline=Pipeline("1f1b", microbatches=2)))
    np.testing.assert_allclose(losses, reference, rtol=RTOL)


@pytest.mark.slow
def test_the_built_in_loss_passes_rngs_to_dropout_and_keeps_label_smoothing():
    model = build(LLAMA, dropout=0.1)
    model.head.kernel[...] = model.head.kernel[...] * 100  # confident logits: smoothing changes the loss
    batch = tokens(0)
    loss = models.loss_for(config(dropout=0.1))
    assert float(loss(model, batch, nnx.Rngs(0))[0]) == float(loss(model, batch, nnx.Rngs(0))[0])
    assert float(loss(model, batch, nnx.Rngs(0))[0]) != float(loss(model, batch, nnx.Rngs(1))[0])  # masks differ
    model.eval()
    plain, _ = loss(model, batch, nnx.Rngs(0))
    smoothed, _ = models.loss_for(config(dropout=0.1).replace(label_smoothing=0.1))(model, batch, nnx.Rngs(0))
    logits = model(jnp.asarray(batch["tokens"][:, :-1]))
    np.testing.assert_allclose(smoothed, models.losses.cross_entropy(logits, batch["tokens"][:, 1:], 0.1), rtol=1e-6)
    assert float(smoothed) != pytest.approx(float(plain), rel=1e-3)


# --- conversion from the unstacked model ---------------------------------------------------------------------------
class OldAttention(nnx.Module):
    """The transformer before issue 19, as it was (models/transformer.py at commit 23ebdd8): blocks in a list,
    Dropout modules owning their RNG streams."""

    def __init__(self, d_model, heads, dropout, rngs):
        init = nnx.initializers.normal(0.02)
        self.qkv = nnx.LinearGeneral(d_model, (3, heads, d_model // heads), use_bias=False, rngs=rngs,
                                     kernel_init=nnx.with_partitioning(init, ("embed", None, "heads", "kv")))
        self.out = nnx.LinearGeneral((heads, d_model // heads), d_model, axis=(-2, -1), use_bias=False, rngs=rngs,
                                     kernel_init=nnx.with_partitioning(init, ("heads", "kv", "embed")))
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        qkv = self.qkv(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / jnp.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), axis=-1)
        return self.dropout(self.out(jnp.einsum("bhqs,bshk->bqhk", probs, v)))


class OldBlock(nnx.Module):
    def __init__(self, d_model, heads, d_ff, dropout, rngs):
        self.norm1 = layer_norm(d_model, "embed", rngs)
        self.attn = OldAttention(d_model, heads, dropout, rngs)
        self.norm2 = layer_norm(d_model, "embed", rngs)
        self.up = dense(d_model, d_ff, ("embed", "mlp"), rngs)
        self.down = dense(d_ff, d_model, ("mlp", "embed"), rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.dropout(self.down(jax.nn.gelu(self.up(self.norm2(x)))))


class OldTransformer(nnx.Module):
    def __init__(self, vocab, seq_len, layers, d_model, heads, d_ff, dropout, *, rngs):
        init = nnx.initializers.normal(0.02)
        self.seq_len = seq_len
        self.token_embed = nnx.Embed(vocab, d_model, rngs=rngs, embedding_init=nnx.with_partitioning(
            init, ("vocab", "embed")))
        self.pos_embed = nnx.Embed(seq_len, d_model, rngs=rngs, embedding_init=nnx.with_partitioning(
            init, (None, "embed")))
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.blocks = nnx.List([OldBlock(d_model, heads, d_ff, dropout, rngs) for _ in range(layers)])
        self.norm = layer_norm(d_model, "embed", rngs)
        self.head = dense(d_model, vocab, ("embed", "vocab"), rngs, use_bias=False)

    def __call__(self, tokens_BxL):
        x = self.dropout(self.token_embed(tokens_BxL) + self.pos_embed(jnp.arange(tokens_BxL.shape[1]))[None])
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def old_model(rngs, layers=3, dropout=0.0):
    return OldTransformer(**SMALL, layers=layers, dropout=dropout, rngs=rngs)


@pytest.mark.slow
def test_unstacked_parameters_convert_to_the_stacked_layout():
    with nnx.use_eager_sharding(False):
        old = old_model(nnx.Rngs(3))
    old_params = nnx.to_pure_dict(nnx.state(old, nnx.Param))
    assert sorted(old_params["blocks"]) == [0, 1, 2]
    stacked = convert.stack_blocks(old_params)
    new = build(GPT, layers=3, seed=9)  # another seed: every parameter comes from the old model
    state = nnx.state(new, nnx.Param)
    nnx.replace_by_pure_dict(state, stacked)
    nnx.update(new, state)
    np.testing.assert_array_equal(np.asarray(new.blocks.layers.up.kernel[...][2]),
                                  np.asarray(old.blocks[2].up.kernel[...]))
    batch = jnp.asarray(tokens(0, size=4, length=16)["tokens"])
    np.testing.assert_allclose(new(batch), old(batch), atol=1e-5)
    # the layouts are each other's inverse; the stacked model's own parameters unstack and stack back to themselves
    own = nnx.to_pure_dict(nnx.state(build(GPT, layers=3), nnx.Param))
    unstacked = convert.unstack_blocks(own)
    assert sorted(unstacked["blocks"]) == [0, 1, 2] and "layers" not in unstacked["blocks"]
    jax.tree.map(np.testing.assert_array_equal, convert.stack_blocks(unstacked), own)
    with pytest.raises(ValueError, match="differ in shape"):
        convert.stack_blocks({"blocks": {0: {"w": np.zeros(2)}, 1: {"w": np.zeros(3)}}})


@pytest.mark.slow
def test_a_checkpoint_of_the_unstacked_model_restores_into_the_stacked_gpt_model(tmp_path):
    """Written by the old model (adamw, sync on 2x4, 2 steps), restored onto the stacked gpt model on another mesh:
    parameters and optimizer state stacked, and the next steps' losses equal the old model's."""
    c = config(GPT)
    old_trainer = jaxpar.Trainer(model=old_model, loss_fn=models.lm_loss, optimizer=optax.adamw(1e-2),
                                 mesh=jaxpar.make_mesh("2x4"))
    old_state, _ = train(old_trainer, steps=2)
    checkpoints = Checkpointer(str(tmp_path / "old"))
    checkpoints.save(2, old_state, old_trainer.strategy, old_trainer.num_replicas)
    checkpoints.wait()
    old_params = old_trainer.params(old_state)
    _, old_next = train(old_trainer, steps=2, state=old_state)

    trainer = jaxpar.Trainer(model=models.factory(c), loss_fn=models.loss_for(c), optimizer=optax.adamw(1e-2),
                             mesh=jaxpar.make_mesh("data=2,fsdp=2,model=2"))
    state, meta, notes = Checkpointer(str(tmp_path / "old")).restore(trainer)
    assert any("stacked into the layout of this model's stacked blocks" in n and "blocks.layers" in n for n in notes)
    jax.tree.map(np.testing.assert_array_equal, trainer.params(state), convert.stack_blocks(old_params))
    _, next_losses = train(trainer, steps=2, state=state)
    np.testing.assert_allclose(next_losses, old_next, rtol=RTOL)


@pytest.mark.slow
def test_a_checkpoint_of_the_unstacked_model_does_not_restore_into_the_llama_block(tmp_path):
    old_trainer = jaxpar.Trainer(model=old_model, loss_fn=models.lm_loss, optimizer=optax.adamw(1e-2),
                                 mesh=jaxpar.make_mesh("1x1"))
    checkpoints = Checkpointer(str(tmp_path / "old"))
    checkpoints.save(0, old_trainer.init(0), old_trainer.strategy, old_trainer.num_replicas)
    checkpoints.wait()
    with pytest.raises(jaxpar.CheckpointError, match="another model"):
        Checkpointer(str(tmp_path / "old")).restore(trainer_for("1x1", LLAMA, optimizer=optax.adamw(1e-2)))


@pytest.mark.slow
def test_the_cli_trains_the_llama_and_the_gpt_block(tmp_path):
    """Each block through run.py: the metrics file records the chosen block, a loss every step that falls on a
    repetitive text, and the held-out evaluation."""
    import json

    import run

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    for block in BLOCKS:
        path = tmp_path / f"{block}.jsonl"
        code = run.main(["--block", block, "--layers", "2", "--d-model", "32", "--heads", "4", "--d-ff", "64",
                         "--seq-len", "16", "--mesh", "1x1", "--steps", "8", "--batch-size", "4", "--log-every", "1",
                         "--eval-batches", "1", "--lr", "1e-2", "--data", str(text), "--metrics", str(path)])
        assert code == 0, block
        config, *records = [json.loads(line) for line in path.read_text().splitlines()]
        assert config["block"] == block
        losses = [r["loss"] for r in records if "loss" in r]
        assert len(losses) == 8, (block, records)
        assert np.mean(losses[-2:]) < losses[0] - 0.3, (block, losses)
        assert any("eval_loss" in r for r in records), block
