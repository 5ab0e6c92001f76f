import jax
import pytest

import jaxpar
from jaxpar.mesh import parse_mesh_spec, resolve_shape


@pytest.mark.parametrize("spec, shape", [("8", (8, 1)), ("2x4", (2, 4)), ("data=2,model=4", (2, 4)),
                                         ("model=4,data=2", (2, 4)), ("model=8", (1, 8)), ("-1", (-1, 1)),
                                         ("-1x4", (-1, 4)), (" 1 X 8 ", (1, 8))])
def test_parse_forms(spec, shape):
    assert parse_mesh_spec(spec) == shape


@pytest.mark.parametrize("spec, words", [("2x", "'' is not an axis size"), ("axb", "'a' is not an axis size"),
                                         ("0x4", "must be >= 1"), ("2x4x2x2", "4 axes given"),
                                         ("-1x-1", "only once"), ("pipe=2", "unknown axis 'pipe'"),
                                         ("data=2,data=4", "given twice"), ("2.5", "not an axis size")])
def test_malformed_specs_raise_one_line_value_errors(spec, words):
    with pytest.raises(jaxpar.MeshError) as info:
        parse_mesh_spec(spec)
    assert isinstance(info.value, ValueError)
    assert words in str(info.value) and repr(spec) in str(info.value) and "\n" not in str(info.value)


def test_make_mesh_shapes_and_axis_names():
    for spec, shape in [("8", (8, 1)), ("2x4", (2, 4)), ("1x8", (1, 8)), ("-1x2", (4, 2)), ("-1", (8, 1))]:
        mesh = jaxpar.make_mesh(spec)
        assert mesh.axis_names == ("data", "model")
        assert (mesh.shape["data"], mesh.shape["model"]) == shape


def test_smaller_mesh_uses_first_devices():
    mesh = jaxpar.make_mesh("1x2")
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()[:2]]
    assert jaxpar.make_mesh("1x1").devices.flat[0] == jax.devices()[0]


def test_too_many_devices_names_both_numbers_and_suggests_a_fit():
    with pytest.raises(jaxpar.MeshError, match=r"'4x4' needs 16 devices but only 8 are available; try --mesh 2x4"):
        jaxpar.make_mesh("4x4")
    with pytest.raises(jaxpar.MeshError, match=r"needs 16 devices but only 8 .* try --mesh 8x1"):
        jaxpar.make_mesh("1x16")
    with pytest.raises(jaxpar.MeshError, match=r"8 devices do not divide by 3; try --mesh 8x1"):
        jaxpar.make_mesh("-1x3")


def test_resolve_fills_the_remaining_devices():
    assert resolve_shape((-1, 4), 8) == (2, 4)
    assert resolve_shape((2, -1), 8) == (2, 4)
