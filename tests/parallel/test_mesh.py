import ast
import os

import jax
import pytest

import jaxpar
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.mesh import parse_mesh_spec, resolve_shape

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# shapes are (data, stage, fsdp, seq, model)
@pytest.mark.parametrize("spec, shape", [
    ("8", (8, 1, 1, 1, 1)), ("2x4", (2, 1, 1, 1, 4)), ("2x2x2", (2, 1, 2, 1, 2)), ("data=2,model=4", (2, 1, 1, 1, 4)),
    ("model=4,data=2", (2, 1, 1, 1, 4)), ("model=8", (1, 1, 1, 1, 8)), ("-1", (-1, 1, 1, 1, 1)), ("-1x4", (-1, 1, 1, 1, 4)),
    (" 1 X 8 ", (1, 1, 1, 1, 8)), ("fsdp=8", (1, 1, 8, 1, 1)), ("data=2,fsdp=2,model=2", (2, 1, 2, 1, 2)),
    ("data=2,fsdp=4", (2, 1, 4, 1, 1)), ("fsdp=-1,model=2", (1, 1, -1, 1, 2))])
def test_parse_forms(spec, shape):
    assert parse_mesh_spec(spec) == shape


@pytest.mark.parametrize("spec, words", [("2x", "'' is not an axis size"), ("axb", "'a' is not an axis size"),
                                         ("0x4", "must be >= 1"), ("2x4x2x2", "4 axes given"),
                                         ("-1x-1", "only once"), ("pipe=2", "unknown axis 'pipe'"),
                                         ("data=2,data=4", "given twice"), ("2.5", "not an axis size"),
                                         ("fsdp=-1,data=-1", "only once")])
def test_malformed_specs_raise_one_line_value_errors(spec, words):
    with pytest.raises(jaxpar.MeshError) as info:
        parse_mesh_spec(spec)
    assert isinstance(info.value, ValueError)
    assert words in str(info.value) and repr(spec) in str(info.value) and "\n" not in str(info.value)


def test_make_mesh_shapes_and_axis_names():
    for spec, shape in [("8", (8, 1, 1, 1, 1)), ("2x4", (2, 1, 1, 1, 4)), ("1x8", (1, 1, 1, 1, 8)), ("-1x2", (4, 1, 1, 1, 2)),
                        ("-1", (8, 1, 1, 1, 1)), ("fsdp=8", (1, 1, 8, 1, 1)), ("data=2,fsdp=2,model=2", (2, 1, 2, 1, 2)),
                        ("data=2,fsdp=-1", (2, 1, 4, 1, 1)), ((2, 4), (2, 1, 1, 1, 4)), ((2, 2, 2), (2, 1, 2, 1, 2))]:
        mesh = jaxpar.make_mesh(spec)
        assert mesh.axis_names == ("data", "stage", "fsdp", "seq", "model")
        assert tuple(mesh.shape[a] for a in mesh.axis_names) == shape, spec


def test_roles():
    mesh = jaxpar.make_mesh("data=2,fsdp=2,model=2")
    assert mesh_lib.batch_ways(mesh) == 4 and mesh_lib.replica_count(mesh) == 2
    assert mesh_lib.BATCH_AXES == ("data", "fsdp") and mesh_lib.GRADIENT_AXES == ("data", "fsdp", "seq")
    assert mesh_lib.PARAMETER_AXES == ("fsdp", "model") and mesh_lib.REPLICA_AXIS == "data"
    assert mesh_lib.WITHIN_REPLICA_AXES == ("stage", "fsdp", "seq", "model")
    assert mesh_lib.AXES == ("data", "stage", "fsdp", "seq", "model") and mesh_lib.STAGE_AXIS == "stage"
    assert mesh_lib.SEQ_AXIS == "seq" and mesh_lib.seq_ways(jaxpar.make_mesh("data=2,seq=4")) == 4


def test_model_axis_is_innermost_so_it_gets_neighbouring_devices():
    mesh = jaxpar.make_mesh("data=2,fsdp=2,model=2")
    ids = [[[d.id for d in row] for row in plane] for plane in mesh.devices[:, 0, :, 0]]
    assert ids == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_smaller_mesh_uses_first_devices():
    mesh = jaxpar.make_mesh("1x2")
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()[:2]]
    assert jaxpar.make_mesh("1x1").devices.flat[0] == jax.devices()[0]


def test_too_many_devices_names_both_numbers_and_suggests_a_fit():
    with pytest.raises(jaxpar.MeshError, match=r"'4x4' needs 16 devices but only 8 are available; try --mesh 2x4"):
        jaxpar.make_mesh("4x4")
    with pytest.raises(jaxpar.MeshError, match=r"needs 16 devices but only 8 .* try --mesh 1x8"):
        jaxpar.make_mesh("1x16")
    with pytest.raises(jaxpar.MeshError, match=r"8 devices do not divide by 3; try --mesh 4x2"):
        jaxpar.make_mesh("-1x3")
    with pytest.raises(jaxpar.MeshError, match=r"needs 16 devices .* try --mesh data=2,fsdp=2,model=2"):
        jaxpar.make_mesh("data=4,fsdp=2,model=2")
    with pytest.raises(jaxpar.MeshError, match=r"needs 16 devices .* try --mesh fsdp=8"):
        jaxpar.make_mesh("fsdp=16")


def test_resolve_fills_the_remaining_devices():
    assert resolve_shape((-1, 1, 1, 1, 4), 8) == (2, 1, 1, 1, 4)
    assert resolve_shape((2, 1, 1, 1, -1), 8) == (2, 1, 1, 1, 4)
    assert resolve_shape((1, 1, -1, 1, 2), 8) == (1, 1, 4, 1, 2)
    assert resolve_shape((1, -1, 1, 1, 2), 8) == (1, 4, 1, 1, 2)


# Calls whose string arguments are mesh axis names: sharding, collectives, meshes.
AXIS_CALLS = {"PartitionSpec", "P", "NamedSharding", "Mesh", "AbstractMesh", "make_mesh", "psum", "pmean", "pmax",
              "pmin", "all_gather", "psum_scatter", "ppermute", "all_to_all", "axis_index", "axis_size",
              "with_sharding_constraint", "shard_map", "reshard", "pbroadcast", "pvary"}


def axis_literals(source: str, axes=mesh_lib.AXES) -> list[int]:
    """Lines spelling a mesh axis name where it is used as one: an argument of a sharding / collective / mesh call, an
    `axis...` / `...spec` keyword, a `.shape[...]` key, a group of axis names (`("data", "fsdp")`), a name bound to
    it (`X = "data"`) or a comparison with it. A config field that happens to be called `model` is none of these."""
    tree = ast.parse(source)
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def is_axis(node):
        return isinstance(node, ast.Constant) and node.value in axes

    def used_as_axis(node) -> bool:
        up = parent.get(node)
        if isinstance(up, (ast.Tuple, ast.List, ast.Set)) and all(
                is_axis(e) or (isinstance(e, ast.Constant) and e.value is None) for e in up.elts):
            return True  # a group of axes, e.g. ("data", "fsdp")
        if isinstance(up, (ast.Assign, ast.AnnAssign, ast.Compare)):
            return True
        if isinstance(up, ast.Subscript) and isinstance(up.value, ast.Attribute) and up.value.attr in (
                "shape", "axis_sizes"):
            return True
        while up is not None and not isinstance(up, ast.stmt):
            if isinstance(up, ast.keyword) and up.arg and ("axis" in up.arg or "axes" in up.arg or "spec" in up.arg):
                return True
            if isinstance(up, ast.Call):
                func = up.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if name in AXIS_CALLS:
                    return True
            up = parent.get(up)
        return False

    return sorted({node.lineno for node in ast.walk(tree) if is_axis(node) and used_as_axis(node)})


def test_the_axis_literal_matcher():
    caught = ['P("data")', 'lax.psum(x, "fsdp")', 'mesh.shape["model"]', 'AXES = ("data", "fsdp")', 'x = "data"',
              'f(y, axis_name="data")', 'ok = a == "model"', 'NamedSharding(m, P(None, ("fsdp", "model")))',
              'jax.sharding.PartitionSpec("data")', 'spec = ("data", None)']
    for line in caught:
        assert axis_literals(line) == [1], line
    ignored = ['check(noun="model")', 'PRIMARY = ("model", "strategy")', 'config["data"]', 'f"{model}"',
               'x = "model_dir"', 'error("model")']
    for line in ignored:
        assert axis_literals(line) == [], line


def test_no_library_module_but_mesh_spells_an_axis_name():
    """The axis names are declared once (jaxpar/parallel/mesh.py); everything else asks for them by role
    (`REPLICA_AXIS`, `BATCH_AXES`, ...). There is no opt-out: a word like `model` used for another purpose (a config
    field) is not used as an axis, so it is not caught."""
    offenders = []
    for folder, dirs, names in os.walk(os.path.join(ROOT, "jaxpar")):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != os.path.join(ROOT, "jaxpar", "parallel", "mesh.py"):
                with open(path, encoding="utf-8") as handle:
                    source = handle.read()
                lines = source.splitlines()
                offenders += [f"{os.path.relpath(path, ROOT)}:{n}: {lines[n - 1].strip()}" for n in axis_literals(source)]
    assert os.path.exists(os.path.join(ROOT, "jaxpar", "parallel", "mesh.py"))
    assert not offenders, f"{len(offenders)} mesh axis names spelled outside jaxpar/parallel/mesh.py:\n" + \
        "\n".join(offenders)
