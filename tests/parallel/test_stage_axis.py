"""The `stage` mesh axis (issue 19): specs, the mesh and its device order, the `layers -> stage` rule, and the one
error a model with nothing to pipeline gets on a mesh with stage > 1 (library and command line)."""

import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import jaxpar
import run
from jaxpar.cli.batching import static_batch_sizes
from jaxpar.cli.config import Config
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.device_grid import device_grid
from jaxpar.parallel.mesh import crossing_axes, format_shape, parse_mesh_spec
from jaxpar.parallel.partitioning import DEFAULT_RULES, spec_for
from tests.helpers import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_STACK = ("mesh stage=2: the model has no stacked layers to split over stages (no parameter has the logical axis "
            "'layers'); build its repeated blocks with jaxpar.pipeline.Stack, or use a mesh without stage")


# --- specs and the mesh ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, shape", [  # (data, stage, fsdp, seq, model)
    ("stage=4", (1, 4, 1, 1, 1)), ("data=2,stage=2,model=2", (2, 2, 1, 1, 2)),
    ("data=2,stage=2,fsdp=2", (2, 2, 2, 1, 1)),
    ("stage=-1", (1, -1, 1, 1, 1)), ("model=2,stage=-1", (1, -1, 1, 1, 2)), ("stage=2,data=4", (4, 2, 1, 1, 1)),
    # the positional forms never name stage
    ("8", (8, 1, 1, 1, 1)), ("2x4", (2, 1, 1, 1, 4)), ("2x2x2", (2, 1, 2, 1, 2))])
def test_specs_parse_to_data_stage_fsdp_model_sizes(spec, shape):
    assert parse_mesh_spec(spec) == shape


def test_four_positional_sizes_are_refused_saying_stage_is_given_by_name():
    with pytest.raises(jaxpar.MeshError, match=r"^--mesh '2x2x2x2': 4 axes given but the short form has at most 3; "
                                               r"the axes data, stage, fsdp, seq, model can all be given by name \("):
        parse_mesh_spec("2x2x2x2")


def test_the_mesh_help_names_the_stage_forms():
    from jaxpar.cli.help import describe

    text = describe("mesh")
    assert text.startswith("device mesh, axes data x stage x fsdp x seq x model; ")
    assert "'stage=4', 'data=2,stage=2,model=2' (the model needs stacked layers)" in text


def test_stage_given_twice_or_twice_minus_one_is_refused():
    with pytest.raises(jaxpar.MeshError, match=r"axis 'stage' given twice"):
        parse_mesh_spec("stage=2,stage=4")
    with pytest.raises(jaxpar.MeshError, match=r"-1 may appear only once"):
        parse_mesh_spec("stage=-1,data=-1")


@pytest.mark.parametrize("spec, shape", [
    ("stage=4", (1, 4, 1, 1, 1)), ("data=2,stage=2,model=2", (2, 2, 1, 1, 2)),
    ("data=2,stage=2,fsdp=2", (2, 2, 2, 1, 1)),
    ("stage=-1", (1, 8, 1, 1, 1)), ("data=2,stage=-1,model=2", (2, 2, 1, 1, 2)),
    ((2, 4), (2, 1, 1, 1, 4)), ((2, 2, 2), (2, 1, 2, 1, 2)), (8, (8, 1, 1, 1, 1))])
def test_make_mesh_has_four_axes_with_stage_second(spec, shape):
    mesh = jaxpar.make_mesh(spec)
    assert mesh.axis_names == ("data", "stage", "fsdp", "seq", "model")
    assert mesh.devices.shape == shape
    assert mesh.axis_types == (AxisType.Auto,) * 5
    mesh_lib.check_mesh(mesh)  # accepted as it is


def test_stage_is_inside_data_and_outside_fsdp_and_model():
    mesh = jaxpar.make_mesh("data=2,stage=2,model=2")
    grid = np.vectorize(lambda d: d.id)(mesh.devices[:, :, :, 0]).tolist()
    assert grid == [[[[0, 1]], [[2, 3]]], [[[4, 5]], [[6, 7]]]]


def test_roles_with_a_stage_axis():
    mesh = jaxpar.make_mesh("data=2,stage=2,fsdp=2")
    assert mesh_lib.STAGE_AXIS == "stage"
    assert mesh_lib.size(mesh, mesh_lib.STAGE_AXIS) == 2
    assert mesh_lib.batch_ways(mesh) == 4  # data x fsdp: the batch is not split over stages
    assert mesh_lib.replica_count(mesh) == 2
    assert mesh_lib.WITHIN_REPLICA_AXES == ("stage", "fsdp", "seq", "model")
    assert mesh_lib.BATCH_AXES == ("data", "fsdp") and mesh_lib.GRADIENT_AXES == ("data", "fsdp", "seq")


def test_format_shape_and_shape_line_name_the_stage_axis():
    assert format_shape((1, 4, 1, 1, 1)) == "stage=4"
    assert format_shape((2, 2, 1, 1, 2)) == "data=2,stage=2,model=2"
    assert format_shape((2, 1, 1, 1, 4)) == "data=2,model=4"
    line = mesh_lib.shape_line(jaxpar.make_mesh("data=2,stage=2,model=2"))
    assert line == "data=2 x stage=2 x fsdp=1 x seq=1 x model=2"
    assert mesh_lib.shape_line(jaxpar.make_mesh("2x4")) == "data=2 x stage=1 x fsdp=1 x seq=1 x model=4"


def test_a_stage_mesh_that_does_not_fit_gets_a_suggestion_that_keeps_the_stages():
    with pytest.raises(jaxpar.MeshError, match=r"^--mesh 'stage=16' needs 16 devices but only 8 are available; "
                                               r"try --mesh stage=8;"):
        jaxpar.make_mesh("stage=16")
    with pytest.raises(jaxpar.MeshError, match=r"'data=2,stage=4,model=2' needs 16 devices .* try --mesh "
                                               r"stage=4,model=2;"):
        jaxpar.make_mesh("data=2,stage=4,model=2")
    with pytest.raises(jaxpar.MeshError, match=r"8 devices do not divide by 3; try --mesh stage=8$"):
        jaxpar.make_mesh("data=3,stage=-1")


def test_check_mesh_names_the_four_axes_for_a_three_axis_mesh():
    old = Mesh(np.asarray(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "model"),
               axis_types=(AxisType.Auto,) * 3)
    with pytest.raises(jaxpar.MeshError, match=r"^mesh with axes \('data', 'fsdp', 'model'\): jaxpar needs a mesh "
                                               r"from jaxpar.make_mesh with axes data, stage, fsdp, seq, model \(or "
                                               r"your own "
                                               r"names for them"):
        mesh_lib.check_mesh(old)


# --- the device order across processes (devices described by id and process) ------------------------------------
def fake_devices(local=4, processes=2, interleaved=False):
    owner = (lambda i: i % processes) if interleaved else (lambda i: i // local)
    return [SimpleNamespace(id=i, process_index=owner(i), platform="cpu") for i in range(local * processes)]


def ids(grid):
    """(data, stage, fsdp, model) device ids of a grid without a seq axis."""
    assert grid.shape[3] == 1
    return np.vectorize(lambda d: d.id)(grid[:, :, :, 0]).tolist()


@pytest.mark.parametrize("spec, local, processes, expected, crossing", [
    # a stage per process: model inside it, the stage-to-stage permutes cross
    ("stage=2,model=4", 4, 2, [[[[0, 1, 2, 3]], [[4, 5, 6, 7]]]], ["stage"]),
    # a replica per process: both stages inside it (stage is filled inside before data)
    ("data=2,stage=2,model=2", 4, 2, [[[[0, 1]], [[2, 3]]], [[[4, 5]], [[6, 7]]]], ["data"]),
    # stage 8 on 2 x 4: 4 inside x 2 across
    ("stage=8", 4, 2, [[[[0]], [[1]], [[2]], [[3]], [[4]], [[5]], [[6]], [[7]]]], ["stage"]),
    # fsdp fills each process; data and stage both cross
    ("data=2,stage=2,fsdp=2", 2, 4, [[[[0], [1]], [[2], [3]]], [[[4], [5]], [[6], [7]]]], ["data", "stage"]),
])
def test_device_order_with_a_stage_axis(spec, local, processes, expected, crossing):
    grid = device_grid(parse_mesh_spec(spec), fake_devices(local, processes))
    assert ids(grid) == expected
    assert crossing_axes(SimpleNamespace(devices=grid)) == crossing


def test_device_order_with_stages_follows_process_not_id():
    # process 0 owns the even ids, process 1 the odd ones: each stage still sits inside one process
    grid = device_grid(parse_mesh_spec("stage=2,model=4"), fake_devices(interleaved=True))
    assert ids(grid) == [[[[0, 2, 4, 6]], [[1, 3, 5, 7]]]]
    assert crossing_axes(SimpleNamespace(devices=grid)) == ["stage"]


# --- the batch is not split over stages --------------------------------------------------------------------------
def test_the_batch_divides_by_data_x_fsdp_only():
    static_batch_sizes(Config(model="mlp", mesh="stage=4", batch_size=6))  # 6 rows, 4 stages: fine
    static_batch_sizes(Config(model="mlp", mesh="data=2,stage=2,fsdp=2", batch_size=12))
    with pytest.raises(jaxpar.ConfigError, match=r"--batch-size 6 .* \(data x fsdp of --mesh data=2,stage=2,fsdp=2\)"):
        static_batch_sizes(Config(model="mlp", mesh="data=2,stage=2,fsdp=2", batch_size=6))


# --- the layers rule ---------------------------------------------------------------------------------------------
def test_default_rules_split_layers_over_stages():
    assert DEFAULT_RULES["layers"] == "stage"
    mesh = jaxpar.make_mesh("stage=2,fsdp=2,model=2")
    assert spec_for(("layers", "embed", "mlp"), DEFAULT_RULES, mesh, "w", (4, 8, 8)) == P("stage", "fsdp", "model")
    assert spec_for(("layers", "mlp"), DEFAULT_RULES, mesh, "b", (4, 8)) == P("stage", "model")
    # no stage axis: the layers dimension stays whole
    assert spec_for(("layers", "embed"), DEFAULT_RULES, jaxpar.make_mesh("2x4"), "w", (3, 8)) == P(None, None)


@pytest.mark.parametrize("strict", [True, False])
def test_layers_that_do_not_divide_by_the_stages_are_an_error_naming_what_works(strict):
    # unlike fsdp, a stage split never bends (strict=False is the default rules' fsdp fallback)
    mesh = jaxpar.make_mesh("stage=4")
    with pytest.raises(jaxpar.ShardingError) as info:
        spec_for(("layers", "embed"), DEFAULT_RULES, mesh, "blocks.w.value", (6, 8), strict=strict)
    assert str(info.value) == ("parameter blocks.w.value of shape (6, 8): dimension 0 (logical 'layers') = 6 is not "
                               "divisible by mesh axis 'stage' of size 4; make that dimension a multiple of 4, or use "
                               "a stage axis that divides 6 (e.g. stage=3)")


# --- through a Trainer -------------------------------------------------------------------------------------------
def partitioned(names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class TwoLinear(nnx.Module):
    """Nothing to pipeline: two layers, no stacked dimension."""

    def __init__(self, rngs):
        self.a = nnx.Linear(8, 16, kernel_init=partitioned(("embed", "mlp")), rngs=rngs)
        self.b = nnx.Linear(16, 4, kernel_init=partitioned(("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.relu(self.a(x)))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 8, kernel_init=partitioned(("embed", "mlp")),
                                 bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",)), rngs=rngs)


class Stacked(nnx.Module):
    """Four identical blocks stacked by nnx.vmap: each parameter gets a leading dimension named `layers`."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return Block(rngs)

        self.blocks = make(rngs)
        self.scale = nnx.Param(jax.numpy.ones((8,)))  # unstacked, unnamed: replicated

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(block, h):
            return block.linear(h)

        return body(self.blocks, x) * self.scale


def loss_fn(model, batch):
    loss = jax.numpy.mean((model(batch["x"]) - batch["y"]) ** 2)
    return loss, {"loss": loss}


def trainer(model, spec, **kw):
    return jaxpar.Trainer(model=model, loss_fn=loss_fn, optimizer=optax.sgd(0.1), mesh=jaxpar.make_mesh(spec), **kw)


def test_a_model_with_nothing_to_pipeline_is_one_error_line_on_a_stage_mesh():
    with pytest.raises(jaxpar.ShardingError) as info:
        trainer(TwoLinear, "stage=2")
    assert str(info.value) == NO_STACK
    assert isinstance(info.value, jaxpar.JaxparError) and "jaxpar.pipeline.Stack" in str(info.value)
    with pytest.raises(jaxpar.ShardingError, match=r"^mesh stage=4: the model has no stacked layers"):
        trainer(TwoLinear, "data=2,stage=4")
    assert trainer(TwoLinear, "2x4").mesh.shape["stage"] == 1  # stage 1: nothing to check


def test_stacked_layers_are_placed_on_the_stage_axis():
    state = trainer(Stacked, "data=2,stage=2,model=2").init(0)
    kernel = state.params["blocks"]["linear"]["kernel"][...]
    bias = state.params["blocks"]["linear"]["bias"][...]
    assert kernel.shape == (4, 8, 8) and kernel.sharding.spec == P("stage", None, "model")
    assert bias.shape == (4, 8) and bias.sharding.spec == P("stage", "model")
    assert state.params["scale"][...].sharding.spec == P()
    assert kernel.addressable_shards[0].data.shape == (2, 8, 4)  # two layers per stage, half of mlp per device
    stage_only = trainer(Stacked, "stage=2").init(0)
    assert stage_only.params["blocks"]["linear"]["kernel"][...].sharding.spec == P("stage", None, None)


def test_a_parameter_named_layers_by_hand_is_placed_on_the_stage_axis():
    class ByHand(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.numpy.zeros((4, 8)), out_sharding=("layers", "embed"))

        def __call__(self, x):
            return x @ self.w[0]

    state = trainer(ByHand, "stage=2,fsdp=2").init(0)
    assert state.params["w"][...].sharding.spec == P("stage", "fsdp")


def test_rules_that_leave_the_layers_out_get_their_own_error_line():
    rules = {"embed": "fsdp", "mlp": "model"}  # no 'layers' rule
    with pytest.raises(jaxpar.ShardingError) as info:
        trainer(Stacked, "stage=2", rules=rules)
    assert str(info.value) == ("mesh stage=2: the model's stacked layers (logical axis 'layers') are not split over "
                               "stages because the rules do not map 'layers' to 'stage'; add that rule "
                               "(jaxpar.DEFAULT_RULES has it), or use a mesh without stage")
    flax_style = [("layers", "stage"), ("embed", "fsdp"), ("mlp", "model")]
    state = trainer(Stacked, "stage=2,model=2", rules=flax_style).init(0)
    assert state.params["blocks"]["linear"]["kernel"][...].sharding.spec == P("stage", None, "model")


# --- the command line --------------------------------------------------------------------------------------------
def test_run_py_mlp_on_a_stage_mesh_is_one_line_and_exit_2(capsys):
    assert run.main(["--model", "mlp", "--mesh", "stage=2", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err == f"run.py: error: {NO_STACK}\n"


@pytest.mark.slow
def test_run_py_in_a_fresh_process():
    done = subprocess.run([sys.executable, "run.py", "--model", "mlp", "--mesh", "stage=2", "--steps", "1"], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == f"run.py: error: {NO_STACK}\n"
    assert "Traceback" not in done.stdout + done.stderr
