"""Pipelining through the Trainer, with a model written like a user's (its own block class and loss, dropout with
call-time rngs): per-step losses and parameters after 3 steps equal the unpipelined stacked model's on 1x1 for
GPipe, circular and 1F1B on stage meshes composed with data, fsdp and model, under Sync and the explicit
strategies, with gradient accumulation; and each misuse is one clear error.

Tolerances: float32; per-step losses rtol 1e-5, parameters after 3 steps atol 2e-5."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.pipeline import Pipeline, Stack

INIT = nnx.initializers.lecun_normal()
RTOL, ATOL = 1e-5, 2e-5


class Block(nnx.Module):
    """A residual MLP block that keeps its own logical names for fsdp / model inside a stage."""

    def __init__(self, rngs, rate=0.2):
        self.up = nnx.Linear(16, 32, use_bias=False, rngs=rngs, kernel_init=nnx.with_partitioning(INIT, ("embed", "mlp")))
        self.down = nnx.Linear(32, 16, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(INIT, ("mlp", "embed")))
        self.drop = nnx.Dropout(rate)

    def __call__(self, x, rngs=None):
        return x + self.drop(self.down(jax.nn.gelu(self.up(x))), rngs=rngs)


class Net(nnx.Module):
    def __init__(self, rngs, layers=4, rate=0.2):
        self.inp = nnx.Linear(8, 16, rngs=rngs, kernel_init=nnx.with_partitioning(INIT, (None, "embed")))
        self.blocks = Stack(lambda r: Block(r, rate), layers, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs, kernel_init=nnx.with_partitioning(INIT, ("embed", None)))

    def __call__(self, x, rngs=None):
        return self.out(self.blocks(self.inp(x), rngs=rngs))


def loss_fn(model, batch, rngs):
    logits = model(batch["x"], rngs=rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


def batches(count=3, size=16):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(size, 8)).astype(np.float32), "y": rng.integers(0, 4, size).astype(np.int32)}
            for _ in range(count)]


def train(mesh, pipeline, rate=0.2, strategy=None, grad_accum=1, layers=4):
    trainer = jaxpar.Trainer(lambda rngs: Net(rngs, layers, rate), loss_fn, optax.adam(1e-2), jaxpar.make_mesh(mesh),
                             pipeline=pipeline, strategy=strategy, grad_accum=grad_accum)
    state = trainer.init(0)
    losses = []
    for batch in batches():
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), trainer.params(state)


_REFERENCE = {}


def reference(microbatches, rate, strategy=None, grad_accum=1, mesh="1x1"):
    key = (microbatches, rate, type(strategy).__name__, grad_accum, mesh)
    if key not in _REFERENCE:
        _REFERENCE[key] = train(mesh, Pipeline(microbatches=microbatches), rate, strategy, grad_accum)
    return _REFERENCE[key]


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=ATOL), got[1], want[1])


SCHEDULES = [Pipeline("gpipe", 4), Pipeline("circular", 4, repeats=2), Pipeline("1f1b", 4)]
MESHES = ["stage=2", "stage=4", "data=2,stage=2,model=2", "data=2,stage=2,fsdp=2"]


# each schedule on two of the meshes, each mesh under at least one schedule (all three schedules on one composed
# mesh without dropout below)
@pytest.mark.slow
@pytest.mark.parametrize("pipeline, mesh", [
    (SCHEDULES[0], MESHES[0]), (SCHEDULES[0], MESHES[3]),
    (Pipeline("circular", 4, repeats=1), MESHES[1]),  # 4 layers do not split into 4 stages x 2 repeats
    (SCHEDULES[1], MESHES[2]), (SCHEDULES[2], MESHES[1]), (SCHEDULES[2], MESHES[2])],
    ids=lambda p: p.schedule if isinstance(p, Pipeline) else p)
def test_pipelined_training_equals_the_unpipelined_stack_with_dropout(pipeline, mesh):
    assert_same(train(mesh, pipeline), reference(4, 0.2))


@pytest.mark.slow
def test_circular_with_two_repeats_on_four_stages_equals_the_unpipelined_stack():
    assert_same(train("stage=4", Pipeline("circular", 4, repeats=2), layers=8),
                train("1x1", Pipeline(microbatches=4), layers=8))


@pytest.mark.parametrize("pipeline", SCHEDULES, ids=lambda p: p.schedule)
@pytest.mark.slow
def test_pipelined_training_equals_the_unpipelined_stack_without_dropout(pipeline):
    assert_same(train("data=2,stage=2,model=2", pipeline, rate=0.0), reference(4, 0.0))


@pytest.mark.slow
def test_without_dropout_the_microbatch_count_does_not_change_the_math():
    assert_same(reference(4, 0.0), reference(1, 0.0))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [jaxpar.LocalSGD(period=2), jaxpar.SSP(staleness=1)],
                         ids=lambda s: type(s).__name__)
def test_the_pipeline_runs_inside_each_replica_of_the_explicit_strategies(strategy):
    """The meeting (local SGD; DiLoCo adds only an outer optimizer on the same average) and the emulated server
    (SSP; ASP is SSP without a bound) each run the replicas' pipelines. (1F1B inside each replica: the explicit
    allreduces below.)"""
    assert_same(train("data=2,stage=2,model=2", Pipeline("gpipe", 4), strategy=strategy),
                reference(4, 0.2, strategy, mesh="data=2"))


@pytest.mark.slow
@pytest.mark.parametrize("allreduce, mesh", [("psum", "data=2,stage=2,model=2"), ("ring", "data=2,stage=2,fsdp=2"),
                                             ("torus2d", "data=4,stage=2"), ("ps", "data=2,stage=4")])
def test_the_pipeline_runs_under_every_explicit_allreduce(allreduce, mesh):
    """Sync with a written allreduce: each replica runs its pipeline on its slice, the average is the algorithm's.
    Equal to the unpipelined stack on 1x1 (the same global batch), as under the partitioner's Sync."""
    strategy = jaxpar.Sync(allreduce, torus_x=2) if allreduce == "torus2d" else jaxpar.Sync(allreduce)
    assert_same(train(mesh, Pipeline("1f1b" if allreduce in ("psum", "ps") else "gpipe", 4), rate=0.0,
                      strategy=strategy), reference(4, 0.0))


@pytest.mark.slow
def test_pipelining_composes_with_gradient_accumulation():
    assert_same(train("data=2,stage=4", Pipeline("1f1b", 2), grad_accum=2), reference(2, 0.2, grad_accum=2))


def test_stacked_parameters_are_split_over_the_stage_axis():
    trainer = jaxpar.Trainer(Net, loss_fn, optax.sgd(0.1), jaxpar.make_mesh("stage=4"), pipeline=Pipeline("1f1b", 4))
    kernel = trainer.init(0).params["blocks"]["layers"]["up"]["kernel"][...]
    assert kernel.shape == (4, 16, 32)
    assert [s.index for s in kernel.addressable_shards][:4] == [(slice(i, i + 1), slice(None), slice(None))
                                                                  for i in range(4)]


def test_a_layer_count_that_does_not_split_into_the_stages_is_one_error():
    with pytest.raises(jaxpar.JaxparError, match="3.*stage") as caught:
        train("stage=2", Pipeline("gpipe", 2), layers=3)
    assert "\n" not in str(caught.value)


def test_microbatches_that_do_not_divide_the_batch_are_one_error():
    with pytest.raises(jaxpar.ConfigError, match=r"16 rows does not split into --microbatches 3"):
        train("stage=2", Pipeline("gpipe", 3))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_microbatches_that_do_not_split_over_the_data_shards_are_one_error(schedule):
    """Inside the stages each data shard works on its own rows of every microbatch (so gradients are averaged over
    data once per step): a microbatch of 1 row cannot split over data=2."""
    with pytest.raises(jaxpar.ConfigError, match=r"^the batch reaching jaxpar.pipeline.Stack of 16 rows in "
                                                 r"--microbatches 16 .* microbatches of 1 rows, which do not split over "
                                                 r"the 2 data shards; use a batch divisible by 32, or fewer microbatches"):
        train("data=2,stage=2", Pipeline(schedule, 16))


def test_circular_needs_as_many_microbatches_as_stages():
    with pytest.raises(jaxpar.ConfigError, match=r"--microbatches 2 on 4 stages.*--microbatches 4 or more"):
        train("stage=4", Pipeline("circular", 2, repeats=2), layers=8)


@pytest.mark.slow
def test_1f1b_refuses_a_stack_called_twice_per_step():
    """Calling one stack twice once gave a wrong loss silently (2.8527 on 1x1 and GPipe, 1.9167 under 1F1B)."""
    class Twice(Net):
        def __call__(self, x, rngs=None):
            return self.out(self.blocks(self.blocks(self.inp(x), rngs=rngs), rngs=rngs))

    trainer = jaxpar.Trainer(lambda rngs: Twice(rngs, rate=0.0), loss_fn, optax.sgd(0.1), jaxpar.make_mesh("stage=2"),
                             pipeline=Pipeline("1f1b", 2))
    with pytest.raises(jaxpar.ModelError, match=r"calls its jaxpar.pipeline.Stack more than once per step.*gpipe"):
        trainer.step(trainer.init(0), batches(1)[0])
    gpipe = jaxpar.Trainer(lambda rngs: Twice(rngs, rate=0.0), loss_fn, optax.sgd(0.1), jaxpar.make_mesh("stage=2"),
                           pipeline=Pipeline("gpipe", 2))
    one = jaxpar.Trainer(lambda rngs: Twice(rngs, rate=0.0), loss_fn, optax.sgd(0.1), jaxpar.make_mesh("1x1"))
    want = float(one.step(one.init(0), batches(1)[0])[1]["loss"])
    np.testing.assert_allclose(float(gpipe.step(gpipe.init(0), batches(1)[0])[1]["loss"]), want, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_layers_after_the_stack_draw_the_whole_batch_masks_at_each_microbatch_rows(schedule):
    """The head runs per microbatch inside the last stage's ticks: each microbatch draws the whole batch's dropout
    masks at its rows (`jaxpar.pipeline.shard_keys` with the microbatch stride), so the masks, the kept fraction
    and the loss equal the unpipelined run's (one key for all once repeated one mask on every microbatch)."""
    class DropHead(Net):
        def __init__(self, rngs):
            super().__init__(rngs, rate=0.0)
            self.drop = nnx.Dropout(0.5)

        def __call__(self, x, rngs=None):
            return self.out(self.drop(self.blocks(self.inp(x), rngs=rngs), rngs=rngs))

    def loss_counting_kept_units(model, batch, rngs):
        loss, metrics = loss_fn(model, batch, rngs)
        kept = (model.drop(jax.numpy.ones((batch["x"].shape[0], 16)), rngs=rngs) > 0).mean()  # a mean: see below
        return loss, {**metrics, "kept": kept.astype(jax.numpy.float32)}

    def kept_and_loss(mesh):
        trainer = jaxpar.Trainer(DropHead, loss_counting_kept_units, optax.sgd(0.1), jaxpar.make_mesh(mesh),
                                 pipeline=Pipeline(schedule, 4))
        metrics = trainer.step(trainer.init(0), batches(1, size=8)[0])[1]
        return float(metrics["kept"]), float(metrics["loss"])

    kept_one, loss_one = kept_and_loss("1x1")
    # the step reports the mean over the 4 microbatches of each one's fraction of kept units (of 2 x 16), which is
    # the whole batch's fraction when the microbatches' masks are the whole batch's at their rows
    for mesh in ("stage=2", "data=2,stage=2"):  # with data=2 each data shard draws its rows of the same masks
        kept, loss = kept_and_loss(mesh)
        assert kept == kept_one and np.isclose(loss, loss_one, rtol=RTOL), (mesh, kept, kept_one, loss, loss_one)


def test_1f1b_needs_exactly_one_stack():
    class TwoStacks(nnx.Module):
        def __init__(self, rngs):
            self.a = Stack(lambda r: Block(r), 2, rngs=rngs)
            self.b = Stack(lambda r: Block(r), 2, rngs=rngs)
            self.out = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x, rngs=None):
            return self.out(self.b(self.a(jax.numpy.tile(x, (1, 2)), rngs=rngs), rngs=rngs))

    trainer = jaxpar.Trainer(TwoStacks, loss_fn, optax.sgd(0.1), jaxpar.make_mesh("stage=2"),
                             pipeline=Pipeline("1f1b", 2))
    with pytest.raises(jaxpar.ModelError, match="2 jaxpar.pipeline.Stack modules; 1F1B pipelines exactly one"):
        trainer.step(trainer.init(0), batches(1)[0])


def test_blocks_that_keep_their_own_rng_streams_are_refused_when_pipelined():
    class StatefulBlock(Block):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)

    class StatefulNet(Net):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.blocks = Stack(StatefulBlock, 4, rngs=rngs)

    trainer = jaxpar.Trainer(StatefulNet, loss_fn, optax.sgd(0.1), jaxpar.make_mesh("stage=2"),
                             pipeline=Pipeline("gpipe", 2))
    with pytest.raises(jaxpar.ModelError, match="is not an nnx.Param.*pass rngs at call time"):
        trainer.step(trainer.init(0), batches(1)[0])


def test_pipeline_argument_is_checked():
    with pytest.raises(jaxpar.ConfigError, match="pass a jaxpar.pipeline.Pipeline"):
        jaxpar.Trainer(Net, loss_fn, optax.sgd(0.1), jaxpar.make_mesh("stage=2"), pipeline="1f1b")
    with pytest.raises(jaxpar.ConfigError, match=r"Pipeline\(schedule='2f2b'\): choose one of gpipe, circular, 1f1b"):
        Pipeline("2f2b")
    with pytest.raises(jaxpar.ConfigError, match=r"repeats=2\) applies to schedule='circular' only"):
        Pipeline("gpipe", 4, repeats=2)


class PlainNet(nnx.Module):
    """A model as a new user first writes it: a Stack of plain `nnx.Linear` blocks, no logical names anywhere."""

    def __init__(self, rngs):
        self.inp = nnx.Linear(8, 16, rngs=rngs)
        self.blocks = Stack(lambda r: nnx.Linear(16, 16, rngs=r), 4, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.out(self.blocks(jax.nn.tanh(self.inp(x))))


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [Pipeline(), Pipeline("1f1b", 2)], ids=["gpipe", "1f1b"])
def test_a_stack_of_plain_linear_blocks_pipelines_and_equals_the_unpipelined_run(pipeline):
    def run(mesh):
        trainer = jaxpar.Trainer(PlainNet, loss_fn, optax.adam(1e-2), jaxpar.make_mesh(mesh), pipeline=pipeline)
        state, losses = trainer.init(0), []
        for batch in batches():
            state, metrics = trainer.step(state, batch)
            losses.append(float(metrics["loss"]))
        return trainer, (np.array(losses), trainer.params(state))

    staged, got = run("data=2,stage=2")
    specs = staged.state_shardings.params["blocks"]["layers"]
    assert specs["kernel"].spec == P("stage", None, None) and specs["bias"].spec == P("stage", None)
    assert_same(got, run("1x1")[1])


@pytest.mark.parametrize("mesh, spec", [("fsdp=2", P(None, "fsdp", None)), ("stage=2,fsdp=2", P("stage", "fsdp", None))])
def test_plain_blocks_keep_the_automatic_fsdp_split_beside_their_stage_split(mesh, spec):
    trainer = jaxpar.Trainer(PlainNet, loss_fn, optax.sgd(0.1), jaxpar.make_mesh(mesh))
    assert trainer.state_shardings.params["blocks"]["layers"]["kernel"].spec == spec  # [4, 16, 16]: the first 16
    assert trainer.notes[0].startswith("the model names no parameter dimensions, so 6 of its 6 parameters are split "
                                       "over fsdp")
