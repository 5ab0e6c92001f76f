"""Library misuse fails with one line: a `jaxpar.JaxparError` subclass naming the argument, the value and a fix."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
import pytest
from flax import nnx

import jaxpar
import models
from jaxpar.errors import ConfigError, DataError, MeshError, ModelError, ShardingError, StateError
from models.losses import check_labels
from tests.helpers import TINY, batch_for, trainer_for


def raises(kind, match):
    """pytest.raises that also checks the message is one line and the error a JaxparError (a ValueError)."""
    return _OneLine(kind, match)


class _OneLine:
    def __init__(self, kind, match):
        self.context = pytest.raises(kind, match=match)

    def __enter__(self):
        self.info = self.context.__enter__()
        return self.info

    def __exit__(self, *exc):
        suppressed = self.context.__exit__(*exc)
        message = str(self.info.value)
        assert isinstance(self.info.value, jaxpar.JaxparError) and "\n" not in message, message
        assert "--" not in message.split("XLA_FLAGS=")[0], f"library message names a CLI flag: {message}"
        return suppressed


@pytest.fixture(scope="module")
def mlp():
    return trainer_for("mlp", "8")


# --- 1 / 7: make_mesh -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    (None, r"^make_mesh\(None\): not a mesh spec; give an int \(data\), a tuple of 1 to 3 sizes"),
    (True, r"^make_mesh\(True\): not a mesh spec"),
    ((2.0, 4), r"^make_mesh\(\(2\.0, 4\)\): size 2\.0 is not an integer"),
    ((-2, -4), r"^make_mesh\(\(-2, -4\)\): size -2 must be >= 1 \(or -1 once\)"),
    ((0, 4), r"^make_mesh\(\(0, 4\)\): size 0 must be >= 1"),
    ((-1, -1), r"^make_mesh\(\(-1, -1\)\): -1 may appear only once"),
    ((1, 2, 2, 2), r"^make_mesh\(\(1, 2, 2, 2\)\): 4 sizes"),
])
def test_bad_mesh_specs(spec, message):
    with raises(MeshError, message):
        jaxpar.make_mesh(spec)


def test_int_mesh_spec_is_the_data_axis():
    assert dict(jaxpar.make_mesh(8).shape) == {"data": 8, "stage": 1, "fsdp": 1, "seq": 1, "model": 1}
    assert dict(jaxpar.make_mesh(np.int64(4)).shape) == {"data": 4, "stage": 1, "fsdp": 1, "seq": 1, "model": 1}
    assert dict(jaxpar.make_mesh((-1, 2)).shape) == {"data": 4, "stage": 1, "fsdp": 1, "seq": 1, "model": 2}


def test_mesh_larger_than_the_started_cpu_devices_says_how_to_get_more():
    with raises(MeshError, r"^make_mesh\(\(4, 4\)\) needs 16 devices but only 8 are available; try "
                           r"make_mesh\('2x4'\); or, for 16 CPU devices, set "
                           r"XLA_FLAGS=--xla_force_host_platform_device_count=16 or call "
                           r"jax.config.update\('jax_num_cpu_devices', 16\) before JAX starts"):
        jaxpar.make_mesh((4, 4))
    with pytest.raises(MeshError) as info:  # devices given explicitly: nothing about XLA flags
        jaxpar.make_mesh((4, 4), devices=jax.devices())
    assert "XLA_FLAGS" not in str(info.value)


# --- 2: rules and foreign meshes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("rules, message", [
    ({"mlp": 5}, r"^rules: rule 'mlp' -> 5 is not a logical name -> mesh axis; rules map a logical name to a mesh "
                 r"axis \(data, stage, fsdp, seq, model\), a tuple of them, or None"),
    ([("mlp", "model", "x")], r"^rules \[\('mlp', 'model', 'x'\)\]: not a dict or a list of pairs"),
    ("mlp", r"^rules 'mlp': not a dict or a list of pairs"),
])
def test_malformed_rules(rules, message):
    with raises(ShardingError, message):
        trainer_for("mlp", "8", rules=rules)


def test_mesh_not_from_make_mesh():
    factory, loss = models.factory(TINY["mlp"]), models.LOSSES["mlp"]
    with raises(MeshError, r"^mesh with axes \('x',\): jaxpar needs a mesh from jaxpar.make_mesh with axes data, "
                           r"stage, fsdp, seq, model"):
        jaxpar.Trainer(factory, loss, optax.sgd(0.1), jax.make_mesh((8,), ("x",)))
    mixed = (AxisType.Explicit, AxisType.Auto, AxisType.Auto, AxisType.Auto, AxisType.Auto)
    with raises(MeshError, r"^mesh with axis types .*: jaxpar needs all axes AxisType.Auto or all AxisType.Explicit"):
        jaxpar.Trainer(factory, loss, optax.sgd(0.1),
                       jax.make_mesh((2, 1, 2, 1, 2), ("data", "stage", "fsdp", "seq", "model"), axis_types=mixed))
    with raises(MeshError, r"^mesh '2x4': not a jax.sharding.Mesh; build it with jaxpar.make_mesh"):
        jaxpar.Trainer(factory, loss, optax.sgd(0.1), "2x4")


# --- 3: the loss_fn contract, at trace time, on the train and eval paths ----------------------------------------
def _logits(model, batch):
    return model(batch["image"])


BAD_LOSSES = [
    (lambda m, b: optax.softmax_cross_entropy_with_integer_labels(_logits(m, b), b["label"]).mean(),
     r"it returned an array of shape \(\) and dtype float32"),
    (lambda m, b: (_logits(m, b).mean(), {}, 1), r"it returned a 3-tuple"),
    (lambda m, b: (_logits(m, b).mean(), [1.0]), r"its metrics are a 1-list \(return \{\} for none\)"),
    (lambda m, b: (_logits(m, b).mean(-1), {}), r"its loss is an array of shape \(16,\) and dtype float32 \(reduce "
                                                 r"it to a float scalar"),
    (lambda m, b: (_logits(m, b).mean(), {"name": "acc"}),
     r"metric 'name' is a str, not a numeric array or scalar"),
]


def test_loss_fn_breaking_the_contract_is_refused_when_traced():
    current = [None]
    trainer = jaxpar.Trainer(models.factory(TINY["mlp"]), lambda m, b: current[0](m, b), optax.sgd(0.1),
                             jaxpar.make_mesh("8"))
    explicit = jaxpar.Trainer(models.factory(TINY["mlp"]), lambda m, b: current[0](m, b), optax.sgd(0.1),
                              jaxpar.make_mesh("8"), strategy=jaxpar.Sync("psum"))
    state, explicit_state, batch = trainer.init(0), explicit.init(0), batch_for("mlp")
    contract = r"^loss_fn must be \(model, batch\[, rngs\]\) -> \(scalar loss, dict of metrics\); "
    for loss, message in BAD_LOSSES:
        current[0] = loss
        with raises(ModelError, contract + message):
            trainer.step(state, batch)
        with raises(ModelError, contract + message):
            trainer.evaluate(state, batch)
        with raises(ModelError, contract + message.replace("16", "2")):  # per replica under shard_map: 16 / 8
            explicit.step(explicit_state, batch)
    current[0] = models.LOSSES["mlp"]
    _, metrics = trainer.step(state, batch)  # nothing was donated by the refused steps
    assert np.isfinite(float(metrics["loss"])) and trainer.trace_counts == {"sync": 1}


# --- 4: the model factory, optimizers, batches ----------------------------------------------------------------------
def test_model_factory_and_optimizer_arguments():
    mesh, loss, factory = jaxpar.make_mesh("8"), models.LOSSES["mlp"], models.factory(TINY["mlp"])
    with raises(ModelError, r"^model: the factory returned NoneType, not an nnx.Module; it must be rngs -> "
                            r"nnx.Module"):
        jaxpar.Trainer(lambda rngs: None, loss, optax.sgd(0.1), mesh)
    with raises(ModelError, r"^model: got Linear; pass a function rngs -> nnx.Module .*not a built module"):
        jaxpar.Trainer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), loss, optax.sgd(0.1), mesh)
    with raises(ModelError, r"^loss_fn 'cross_entropy': not a function"):
        jaxpar.Trainer(factory, "cross_entropy", optax.sgd(0.1), mesh)
    with raises(ConfigError, r"^optimizer 'adam': not an optax GradientTransformation \(an object with init and "
                             r"update\); pass e.g. optax.adamw\(1e-3\)"):
        jaxpar.Trainer(factory, loss, "adam", mesh)
    with raises(ConfigError, r"^optimizer <function adam .*>: not an optax GradientTransformation"):
        jaxpar.Trainer(factory, loss, optax.adam, mesh)  # the function, not called
    with raises(ConfigError, r"^DiLoCo\(outer_optimizer='sgd'\): not an optax GradientTransformation"):
        jaxpar.DiLoCo(outer_optimizer="sgd")
    with raises(ConfigError, r"^strategy 'local_sgd': not a strategy \(it lacks init, reduce, shardings, steps, plan, "
                             r"name; .*\); pass e.g. jaxpar.Sync\(\)"):
        jaxpar.Trainer(factory, loss, optax.sgd(0.1), mesh, strategy="local_sgd")

    no_plan = jaxpar.Sync()  # a strategy that lacks one member of the core is told which
    no_plan.plan = None
    with raises(ConfigError, r"^strategy .*: not a strategy \(it lacks plan; "):
        jaxpar.Trainer(factory, loss, optax.sgd(0.1), mesh, strategy=no_plan)


def test_a_model_factory_that_raises_is_a_model_error_naming_it():
    mesh, loss = jaxpar.make_mesh("8"), models.LOSSES["mlp"]
    with raises(ModelError, r"^model <lambda>: the factory raised ZeroDivisionError: division by zero; it must build "
                            r"the model, rngs -> nnx.Module") as info:
        jaxpar.Trainer(lambda rngs: 1 / 0, loss, optax.sgd(0.1), mesh)
    assert isinstance(info.value.__cause__, ZeroDivisionError)

    def make_model(rngs):
        raise ValueError("width 7 is not even\nsecond line")

    with raises(ModelError, r"^model make_model: the factory raised ValueError: width 7 is not even; ") as info:
        jaxpar.Trainer(make_model, loss, optax.sgd(0.1), mesh)
    assert isinstance(info.value.__cause__, ValueError)


def test_bad_batches(mlp):
    state, good = mlp.init(0), batch_for("mlp")
    ragged = {"image": [[1.0, 2.0], [3.0]] * 8, "label": good["label"]}
    with raises(DataError, r"^batch has 0 rows; a global batch needs a positive multiple of 8 rows"):
        mlp.step(state, {k: v[:0] for k, v in good.items()})
    with raises(DataError, r"^batch\['image'\]: list is not a numeric array \(ragged lists or non-numbers\)"):
        mlp.step(state, ragged)
    with raises(DataError, r"^batch\['label'\]: ndarray is not a numeric array"):
        mlp.step(state, {"image": good["image"], "label": np.array(["cat"] * 16)})
    with raises(DataError, r"^batch: got tuple; a batch is a dict of arrays"):
        mlp.step(state, (good["image"], good["label"]))
    with raises(DataError, r"^batch: got dict \(empty\)"):
        mlp.step(state, {})
    with raises(DataError, r"^batch arrays must share a leading example dimension; got leading sizes "
                           r"\{'image': 16, 'label': None\}"):
        mlp.step(state, {"image": good["image"], "label": 3})


def test_a_batch_of_python_lists_is_converted_with_np_asarray(mlp):
    state, good = mlp.init(0), batch_for("mlp")
    as_lists = {k: v.tolist() for k, v in good.items()}
    expected = {k: float(v) for k, v in mlp.evaluate(state, good).items()}
    assert {k: float(v) for k, v in mlp.evaluate(state, as_lists).items()} == pytest.approx(expected)
    _, metrics = mlp.step(state, as_lists)
    assert float(metrics["loss"]) == pytest.approx(expected["loss"], rel=1e-6)


# --- 5: donated states, seeds, steps, strategy arguments ------------------------------------------------------------
def test_reusing_a_donated_state(mlp):
    state, batch = mlp.init(0), batch_for("mlp")
    new_state, _ = mlp.step(state, batch)
    donated = r"^state: its arrays were donated to an earlier call; `step` donates its state: use the state it returned"
    for call in (lambda: mlp.step(state, batch), lambda: mlp.evaluate(state, batch), lambda: mlp.params(state),
                 lambda: mlp.fit(state, iter([batch]), steps=1)):
        with raises(StateError, donated):
            call()
    with raises(StateError, r"^state: got dict; pass the TrainState from trainer.init or trainer.step"):
        mlp.step({"params": 1}, batch)
    assert int(mlp.step(new_state, batch)[0].step) == 2  # the returned state is fine


@pytest.mark.parametrize("seed", [-1, 2**40, 1.7, True, "0", None])
def test_bad_seeds(mlp, seed):
    with raises(ConfigError, rf"^seed {re.escape(repr(seed))}: must be an integer in \[0, 2\*\*32\)$"):
        mlp.init(seed)


def test_largest_seed_and_numpy_seeds_are_fine(mlp):
    assert int(mlp.init(2**32 - 1).step) == 0 and int(mlp.init(np.int64(3)).step) == 0


@pytest.mark.parametrize("steps", [-3, 2.5, True, None])
def test_bad_fit_steps(mlp, steps):
    with raises(ConfigError, rf"^steps {re.escape(repr(steps))}: must be an integer >= 0"):
        mlp.fit(mlp.init(0), iter([]), steps=steps)


def test_fit_zero_steps_returns_the_state(mlp):
    state = mlp.init(0)
    assert mlp.fit(state, iter([]), steps=0) is state


@pytest.mark.parametrize("make, message", [
    (lambda: jaxpar.LocalSGD(period=True), r"^LocalSGD\(period=True\): must be an integer >= 1"),
    (lambda: jaxpar.LocalSGD(period=0), r"^LocalSGD\(period=0\): must be an integer >= 1"),
    (lambda: jaxpar.LocalSGD(local_after=False), r"^LocalSGD\(local_after=False\): must be an integer >= 0"),
    (lambda: jaxpar.DiLoCo(period=2.0), r"^DiLoCo\(period=2.0\): must be an integer >= 1"),
    (lambda: jaxpar.DiLoCo(local_after=True), r"^DiLoCo\(local_after=True\): must be an integer >= 0"),
    (lambda: jaxpar.SSP(staleness=True), r"^SSP\(staleness=True\): must be an integer >= 0"),
    (lambda: jaxpar.SSP(staleness=-1), r"^SSP\(staleness=-1\): must be an integer >= 0"),
    (lambda: jaxpar.SSP(horizon=True), r"^SSP\(horizon=True\): must be an integer >= 1"),
    (lambda: jaxpar.ASP(horizon=False), r"^ASP\(horizon=False\): must be an integer >= 1"),
    (lambda: jaxpar.ASP(max_buffer_bytes=True), r"^ASP\(max_buffer_bytes=True\): must be an integer >= 1"),
    (lambda: jaxpar.Sync("torus2d", torus_x=True), r"^Sync\(torus_x=True\): must be an integer >= 1"),
    (lambda: jaxpar.LocalSGD(torus_x=2.0, allreduce="torus2d"), r"^LocalSGD\(torus_x=2.0\): must be an integer"),
    (lambda: jaxpar.Sync(allreduce=True), r"^Sync\(allreduce=True\): must be None or one of 'psum'"),
    (lambda: jaxpar.SSP(stragglers=True), r"^SSP\(stragglers=True\): must be None or a profile string"),
])
def test_strategy_arguments_refuse_bools_and_non_integers(make, message):
    with raises(ConfigError, message):
        make()


def test_strategy_integer_arguments_accept_numpy_integers():
    assert jaxpar.LocalSGD(period=np.int64(2)).period == 2 and jaxpar.SSP(staleness=np.int32(0)).bound == 0


# --- 6: library messages name arguments, not CLI flags --------------------------------------------------------------
def test_grad_accum_and_batch_size_messages_name_the_argument():
    with raises(ConfigError, r"^grad_accum 0: must be an integer >= 1"):
        trainer_for("mlp", "8", grad_accum=0)
    with raises(ConfigError, r"^grad_accum True: must be an integer >= 1"):
        trainer_for("mlp", "8", grad_accum=True)
    trainer = trainer_for("mlp", "2x4", grad_accum=3)
    state = trainer.init(0)
    with raises(ConfigError, r"^grad_accum 3 does not divide the per-replica batch 8 \(global 16 / 2 replicas\); "
                             r"use a divisor of 8$"):
        trainer.step(state, batch_for("mlp", size=16))
    with raises(DataError, r"^global batch size 31 does not divide by the 2 devices the batch is split over \(data x "
                           r"fsdp\); use a multiple of 2, e.g. 30$"):
        trainer.step(state, batch_for("mlp", size=31))


def test_strategy_errors_raised_against_the_mesh_name_the_argument():
    """The same errors on the command line name the flag (tests/cli/test_cli_failures.py)."""
    with raises(jaxpar.OptionError, r"^stragglers='9:2.0': replica 9 does not exist; the data axis has size 4, so use "
                                    r"replicas 0..3$"):
        trainer_for("mlp", "4x2", strategy=jaxpar.SSP(stragglers="9:2.0"))
    with raises(jaxpar.OptionError, r"^torus_x=3: does not divide the data axis size 4; use one of: 1, 2, 4$"):
        trainer_for("mlp", "4x2", strategy=jaxpar.Sync("torus2d", torus_x=3))
    with raises(jaxpar.OptionError, r"^strategy='asp': the schedule's largest staleness is 1, .* bound it with "
                                    r"strategy ssp and a staleness S$"):
        trainer_for("mlp", "4x2", strategy=jaxpar.ASP(stragglers="3:2.0", horizon=50, max_buffer_bytes=1000))


# --- 8: labels outside the classes ----------------------------------------------------------------------------------
def test_check_labels():
    good = batch_for("mlp")
    check_labels(good, 10)
    check_labels(batch_for("transformer"), 256)
    check_labels({"image": good["image"]}, 10)  # no label key: nothing to check
    with raises(DataError, r"^batch\['label'\]: labels range over \[\d, 10\] but the model has 10 classes; labels "
                           r"must be integers in \[0, 10\)"):
        check_labels({**good, "label": np.where(np.arange(16) == 3, 10, good["label"])}, 10)
    with raises(DataError, r"^batch\['label'\]: labels range over \[-1, "):
        check_labels({**good, "label": np.full(16, -1)}, 10)
    with raises(DataError, r"^batch\['tokens'\]: labels range over \[0, 300\] but the model has 256 classes"):
        check_labels({"tokens": jnp.array([[0, 300]])}, 256)
    with raises(DataError, r"^batch\['label'\]: labels of dtype float32; they must be integers in \[0, 10\)"):
        check_labels({**good, "label": good["label"].astype(np.float32)}, 10)


# --- 9: a new batch shape recompiles: warned once per shape -------------------------------------------------------
def test_a_new_batch_shape_warns_once():
    trainer = trainer_for("mlp", "8")
    state = trainer.init(0)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    notes = logging.getLogger("jaxpar")  # its own handler: run.main may have stopped it propagating to the root
    notes.addHandler(handler)
    try:
        for size in (16, 16, 8, 8, 16, 24):
            state, _ = trainer.step(state, batch_for("mlp", size=size))
    finally:
        notes.removeHandler(handler)
    warnings = [r.getMessage() for r in records if "compiles again" in r.getMessage()]
    assert len(warnings) == 2 and trainer.trace_counts == {"sync": 3}, warnings
    assert warnings[0].startswith("step variant 'sync' compiles again (compilation 2) for a new batch shape "
                                  "{image: float32[8, 8, 8, 1], label: int32[8]}")
    assert "label: int32[24]" in warnings[1]


class Huge(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.zeros((2**36,), jnp.float32))  # 256 GiB

    def __call__(self, x):
        return x.sum() * self.w[0]


def test_a_train_state_too_large_for_a_device_is_refused_before_allocating_never_a_hang():
    trainer = jaxpar.Trainer(Huge, lambda m, b: (m(b["x"]), {}), optax.sgd(0.1), jaxpar.make_mesh("1x1"))
    with raises(jaxpar.ResourceError, r"^the train state needs 274,877,906,9\d\d bytes per device but a device has "
                                      r"[\d,]+; use a smaller model"):
        trainer.init(0)


# --- 10: an exception inside the model or loss: one ModelError line with the step and the batch's shapes ------------
class Boom(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.ones((3,)))

    def __call__(self, x):
        raise ValueError("boom\nsecond line")


def test_an_exception_in_the_model_is_a_model_error_with_the_step_the_batch_and_the_cause():
    trainer = jaxpar.Trainer(Boom, lambda m, b: (m(b["x"]), {}), optax.sgd(0.1), jaxpar.make_mesh("8"))
    batch = {"x": np.zeros((16, 3), np.float32), "y": np.zeros((16,), np.int32)}
    expected = (r"^step 0, batch \{x: \(16, 3\) float32, y: \(16,\) int32\}: the model or loss_fn raised "
                r"ValueError: boom$")
    with raises(jaxpar.errors.ModelCallError, expected) as info:
        trainer.step(trainer.init(0), batch)
    assert isinstance(info.value, ModelError) and isinstance(info.value.__cause__, ValueError)
    with raises(jaxpar.FitError, expected) as info:
        trainer.fit(trainer.init(0), iter([batch]), steps=1)
    assert isinstance(info.value.__cause__, ValueError) and info.value.step == 0
    with raises(ModelError, r"^evaluate at step 0, batch \{x: .*ValueError: boom$") as info:
        trainer.evaluate(trainer.init(0), batch)
    assert isinstance(info.value.__cause__, ValueError)


def test_jaxpar_errors_and_interrupts_in_the_loss_pass_unchanged():
    def refuses(model, batch):
        raise DataError("labels out of range")

    trainer = jaxpar.Trainer(Boom, refuses, optax.sgd(0.1), jaxpar.make_mesh("8"))
    with raises(DataError, r"^labels out of range"):  # (JAX adds a note about its traceback filtering)
        trainer.step(trainer.init(0), {"x": np.zeros((16, 3), np.float32)})

    def interrupted(model, batch):
        raise KeyboardInterrupt

    trainer = jaxpar.Trainer(Boom, interrupted, optax.sgd(0.1), jaxpar.make_mesh("8"))
    with pytest.raises(KeyboardInterrupt):
        trainer.step(trainer.init(0), {"x": np.zeros((16, 3), np.float32)})
