"""`python -m jaxpar.calibrate` / `jaxpar.cost.calibration`: the fit recovers a known machine exactly, the
measurements run on real devices, the CLI writes a profile, and across two processes the axis that crosses them is
told apart from the one inside a process."""

import json
import math
import os
import subprocess
import sys

import pytest

import jaxpar
from jaxpar import calibrate as cli
from jaxpar.cost import calibration as cal
from jaxpar.cost.hardware import Link, Profile, collective_seconds
from jaxpar.cost.hlo import Collective

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_fit_uses_the_cost_models_own_formulas():
    # ring all-reduce over 4: 2(g-1) = 6 latency steps, 2(g-1)/g = 1.5 x the bytes; all-gather (g-1), (g-1)/g
    assert cal.coefficients("all-reduce", 4) == (6.0, 1.5)
    assert cal.coefficients("all-gather", 4) == (3.0, 0.75)
    assert cal.coefficients("reduce-scatter", 4) == (3.0, 3.0)
    assert cal.coefficients("collective-permute", 4) == (1.0, 1.0)


def _known_machine(alpha, bandwidth):
    """A fake measurement: exactly what the cost model says a link of (alpha, bandwidth) costs."""
    def measure(axis, kind, nbytes):
        op = Collective(kind, nbytes, MESH.shape[axis], None, pairs=((0, 1),))
        return collective_seconds(op, Profile("known", 1.0, {None: Link(alpha, bandwidth)}))

    return measure


MESH = jaxpar.make_mesh("2x4")


def test_a_known_machine_is_recovered_exactly():
    profile = cal.calibrate(MESH, measure=_known_machine(7e-6, 3e9), flops=2.5e12)
    assert profile["flops"] == 2.5e12
    assert set(profile["links"]) == {"data", "stage", "fsdp", "model"}
    for axis in ("data", "model"):  # measured: every kind gives the same link back
        for kind in cal.KINDS:
            fitted = profile["calibration"]["axes"][axis][kind]
            assert math.isclose(fitted["alpha"], 7e-6, rel_tol=1e-6), (axis, kind, fitted["alpha"])
            assert math.isclose(fitted["bandwidth"], 3e9, rel_tol=1e-6), (axis, kind, fitted["bandwidth"])
            assert fitted["fit"]["worst_relative_error"] < 1e-9
        assert profile["calibration"]["axes"][axis]["crosses_processes"] is False
    assert profile["links"]["fsdp"] == profile["links"]["data"] or profile["links"]["fsdp"] == profile["links"]["model"]
    assert "stage, fsdp not in the mesh" in profile["source"]


def test_a_latency_below_the_noise_is_zero_and_said():
    fit = cal.fit_line([1000, 2000, 4000], [0.9e-6, 2.1e-6, 4.0e-6])  # intercept < 0
    link = cal.link_from_fit("all-reduce", 2, fit)
    assert link["alpha"] == 0.0 and "negative intercept" in link["note"]
    # times that do not grow with the size: the largest message bounds the bandwidth, the smallest gives alpha
    flat = cal.link_from_fit("all-reduce", 2, cal.fit_line([1000, 2000], [3e-6, 2e-6]), [1000, 2000], [3e-6, 2e-6])
    assert flat["bandwidth"] == 1.0 * 2000 / 3e-6 and flat["alpha"] == 2e-6 / 2 and "lower bound" in flat["note"]


def test_the_measurements_run_on_the_devices():
    mesh = jaxpar.make_mesh("8")
    assert 1e6 < cal.matmul_flops(mesh, 64, trips=2, repeats=1) < 1e14
    for kind in cal.KINDS:
        seconds = cal.collective_seconds_measured(mesh, "data", kind, 4096, trips=2, repeats=1)
        assert 0 < seconds < 1.0, kind


def test_cli_writes_a_profile_that_names_every_axis(tmp_path, capsys):
    out = tmp_path / "machine.json"
    code = cli.main(["--mesh", "2x4", "--out", str(out), "--sizes", "4096,2097152", "--matmul-sizes", "64",
                     "--repeats", "1", "--trips", "2"])
    assert code == 0
    profile = json.loads(out.read_text())
    assert profile["flops"] > 0 and set(profile["links"]) == {"data", "stage", "fsdp", "model"}
    assert profile["calibration"]["mesh"] == {"data": 2, "stage": 1, "fsdp": 1, "model": 4}
    assert os.listdir(tmp_path) == ["machine.json"]
    assert f"use it with run.py --hardware {out}" in capsys.readouterr().err
    loaded = jaxpar.parse_hardware(str(out))  # what --hardware FILE reads
    assert loaded.sustained == profile["flops"] and loaded.links["model"].bandwidth == profile["links"]["model"]["bandwidth"]
    assert loaded.devices_per_node is None  # one process: no nodes


@pytest.mark.parametrize("argv, needle", [
    (["--sizes", "4096"], "--sizes 4096: a line needs at least 2 message sizes"),
    (["--sizes", "4096,abc"], "--sizes '4096,abc': give distinct comma-separated integers >= 64"),
    (["--repeats", "0"], "--repeats 0: give an integer >= 1"),
    (["--mesh", "1"], "no axis has more than one device"),
    (["--out", "/nonexistent-folder/x.json"], "--out '/nonexistent-folder/x.json': the folder"),
])
def test_a_bad_argument_is_one_line_and_exit_2(argv, needle, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own checks (types) exit
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_across_two_processes_the_axis_between_them_is_told_apart(tmp_path):
    out = tmp_path / "two.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["PYTHONPATH"] = ROOT
    result = subprocess.run(
        [sys.executable, "-m", "jaxpar.launch", "--nproc", "2", "--devices-per-process", "4", "--", "-m",
         "jaxpar.calibrate", "--mesh", "2x4", "--out", str(out), "--sizes", "4096,2097152", "--matmul-sizes", "64",
         "--repeats", "1", "--trips", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    axes = json.loads(out.read_text())["calibration"]["axes"]
    assert axes["data"]["crosses_processes"] is True  # data is the outer axis: one half on each process
    assert axes["model"]["crosses_processes"] is False
    profile = json.loads(out.read_text())
    assert profile["calibration"]["processes"] == 2
    # a process is a node: the link between them is inter_node, the model axis's is the one inside
    assert profile["devices_per_node"] == 4 and profile["inter_node"] == {
        k: axes["data"]["all-reduce"][k] for k in ("alpha", "bandwidth")}
    assert profile["links"]["data"] == profile["links"]["model"] == {
        k: axes["model"]["all-reduce"][k] for k in ("alpha", "bandwidth")}
    assert jaxpar.parse_hardware(str(out)).inter_node.bandwidth == profile["inter_node"]["bandwidth"]


def test_the_launch_time_is_measured_and_every_step_pays_it():
    from jaxpar.cost.hardware import step_cost

    assert 0 < cal.launch_seconds(MESH, repeats=3) < 1.0
    flat = Profile("p", 1e9, {None: Link(0.0, 1e9)})
    launched = Profile("p", 1e9, {None: Link(0.0, 1e9)}, launch=1e-3)
    assert step_cost(2e9, [], flat).compute == 2.0
    assert step_cost(2e9, [], launched).compute == 2.001
    assert jaxpar.parse_hardware("a100-nvlink,launch=2e-5").launch == 2e-5
