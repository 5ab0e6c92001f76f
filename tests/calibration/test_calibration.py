"""`python -m jaxpar.calibrate` / `jaxpar.calibration`: the least-squares lines recover a known machine exactly, the
measurements run on real devices, the CLI writes a profile, and across two processes the axis that crosses them is
told apart from the one inside a process."""

import json
import math
import os
import subprocess
import sys

import pytest

import jaxpar
from jaxpar.calibration import command as cli
from jaxpar.calibration import links, machine, model_step, timing
from jaxpar.calibration.model import calibrate_model
from jaxpar.cost.hardware import collective_seconds
from jaxpar.cost.hlo import Collective
from jaxpar.cost.profile import Link, Profile
from tests.helpers import ROOT, child_env


def test_the_lines_use_the_cost_models_own_formulas():
    # ring all-reduce over 4: 2(g-1) = 6 latency steps, 2(g-1)/g = 1.5 x the bytes; all-gather (g-1), (g-1)/g
    assert links.coefficients("all-reduce", 4) == (6.0, 1.5)
    assert links.coefficients("all-gather", 4) == (3.0, 0.75)
    assert links.coefficients("reduce-scatter", 4) == (3.0, 3.0)
    assert links.coefficients("collective-permute", 4) == (1.0, 1.0)


def _known_machine(alpha, bandwidth):
    """A fake measurement: exactly what the cost model says a link of (alpha, bandwidth) costs."""
    def measure(axis, kind, nbytes):
        op = Collective(kind, nbytes, MESH.shape[axis], None, pairs=((0, 1),))
        return collective_seconds(op, Profile("known", 1.0, {None: Link(alpha, bandwidth)}))

    return measure


MESH = jaxpar.make_mesh("2x4")


def test_a_known_machine_is_recovered_exactly():
    profile = machine.calibrate(MESH, measure=_known_machine(7e-6, 3e9), flops=2.5e12)
    assert profile["flops"] == 2.5e12
    assert set(profile["links"]) == {"data", "stage", "fsdp", "seq", "model"}
    for axis in ("data", "model"):  # measured: every kind gives the same link back
        for kind in links.KINDS:
            fitted = profile["calibration"]["axes"][axis][kind]
            assert math.isclose(fitted["alpha"], 7e-6, rel_tol=1e-6), (axis, kind, fitted["alpha"])
            assert math.isclose(fitted["bandwidth"], 3e9, rel_tol=1e-6), (axis, kind, fitted["bandwidth"])
            assert fitted["fit"]["worst_relative_error"] < 1e-9
        assert profile["calibration"]["axes"][axis]["crosses_processes"] is False
    assert profile["links"]["fsdp"] == profile["links"]["data"] or profile["links"]["fsdp"] == profile["links"]["model"]
    assert "stage, fsdp, seq not in the mesh" in profile["source"]


def test_a_latency_below_the_noise_is_zero_and_said():
    line = links.least_squares_line([1000, 2000, 4000], [0.9e-6, 2.1e-6, 4.0e-6])  # intercept < 0
    link = links.link_from_line("all-reduce", 2, line)
    assert link["alpha"] == 0.0 and "negative intercept" in link["note"]
    # times that do not grow with the size: the largest message bounds the bandwidth, the smallest gives alpha
    flat = links.link_from_line("all-reduce", 2, links.least_squares_line([1000, 2000], [3e-6, 2e-6]), [1000, 2000],
                                [3e-6, 2e-6])
    assert flat["bandwidth"] == 1.0 * 2000 / 3e-6 and flat["alpha"] == 2e-6 / 2 and "lower bound" in flat["note"]


def test_the_measurements_run_on_the_devices():
    mesh = jaxpar.make_mesh("8")
    assert 1e6 < machine.matmul_flops(mesh, 64, trips=2, repeats=1) < 1e14
    for kind in links.KINDS:
        seconds = links.collective_seconds_measured(mesh, "data", kind, 4096, trips=2, repeats=1)
        assert 0 < seconds < 1.0, kind


@pytest.mark.slow
def test_cli_writes_a_profile_that_names_every_axis(tmp_path, capsys):
    out = tmp_path / "machine.json"
    code = cli.main(["--mesh", "2x4", "--out", str(out), "--sizes", "4096,65536", "--matmul-sizes", "64",
                     "--repeats", "1", "--trips", "2"])
    assert code == 0
    profile = json.loads(out.read_text())
    assert profile["flops"] > 0 and set(profile["links"]) == {"data", "stage", "fsdp", "seq", "model"}
    assert profile["calibration"]["mesh"] == {"data": 2, "stage": 1, "fsdp": 1, "seq": 1, "model": 4}
    assert os.listdir(tmp_path) == ["machine.json"]
    assert f"use it with run.py --hardware {out}" in capsys.readouterr().err
    loaded = jaxpar.parse_hardware(str(out))  # what --hardware FILE reads
    assert loaded.sustained == profile["flops"] and loaded.links["model"].bandwidth == profile["links"]["model"]["bandwidth"]
    assert loaded.devices_per_node is None  # one process: no nodes


@pytest.mark.parametrize("argv, needle", [
    (["--sizes", "4096"], "--sizes 4096: a line needs at least 2 message sizes"),
    (["--sizes", "4096,abc"], "--sizes '4096,abc': give distinct comma-separated integers >= 64"),
    (["--repeats", "0"], "--repeats 0: give an integer >= 1"),
    (["--codecs", "int4"], "--codecs int4: 'int4' is not a codec calibration times"),
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


@pytest.mark.slow
def test_across_two_processes_the_axis_between_them_is_told_apart(tmp_path):
    out = tmp_path / "two.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["PYTHONPATH"] = ROOT
    result = subprocess.run(
        [sys.executable, "-m", "jaxpar.launch", "--nproc", "2", "--devices-per-process", "4", "--", "-m",
         "jaxpar.calibrate", "--mesh", "2x4", "--out", str(out), "--sizes", "4096,65536", "--matmul-sizes", "64",
         "--repeats", "1", "--trips", "2", "--codecs", "none"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=240)
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

    assert 0 < timing.launch_seconds(MESH, repeats=3) < 1.0
    flat = Profile("p", 1e9, {None: Link(0.0, 1e9)})
    launched = Profile("p", 1e9, {None: Link(0.0, 1e9)}, launch=1e-3)
    assert step_cost(2e9, [], flat).compute == 2.0
    assert step_cost(2e9, [], launched).compute == 2.001
    assert jaxpar.parse_hardware("a100-nvlink,launch=2e-5").launch == 2e-5


def _kinds_machine(alpha, bandwidth, permute_alpha):
    """A known machine whose collective-permute has its own latency (as XLA:CPU's: several times an all-reduce's)."""
    plain, permute = _known_machine(alpha, bandwidth), _known_machine(permute_alpha, bandwidth)
    return lambda axis, kind, nbytes: (permute if kind == "collective-permute" else plain)(axis, kind, nbytes)


def test_each_collective_kind_keeps_its_own_link_and_is_priced_on_it():
    found = machine.calibrate(MESH, measure=_kinds_machine(7e-6, 3e9, 150e-6), flops=2.5e12)
    assert math.isclose(found["links"]["data"]["alpha"], 7e-6, rel_tol=1e-6)  # links: the all-reduce fit
    own = found["kinds"]["collective-permute"]
    assert set(own) == {"data", "stage", "fsdp", "seq", "model"}
    assert math.isclose(own["data"]["alpha"], 150e-6, rel_tol=1e-6)
    assert math.isclose(found["kinds"]["all-gather"]["model"]["alpha"], 7e-6, rel_tol=1e-6)
    profile = Profile.from_dict(found)  # what --hardware FILE reads
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    permute = Collective("collective-permute", 3000, 2, ("data",), pairs=((0, 1),))
    assert math.isclose(collective_seconds(permute, profile), 150e-6 + 3000 / 3e9, rel_tol=1e-9)
    allreduce = Collective("all-reduce", 3000, 2, ("data",))
    assert math.isclose(collective_seconds(allreduce, profile), 2 * (7e-6 + 1500 / 3e9), rel_tol=1e-6)


def test_a_kinds_entry_that_is_not_a_collective_kind_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"name": "p", "flops": 1e9, "links": {"data": {"alpha": 0, "bandwidth": 1e9}},
                                "kinds": {"all-to-some": {"data": {"alpha": 0, "bandwidth": 1e9}}}}))
    with pytest.raises(jaxpar.JaxparError, match="'kinds' must map collective kinds"):
        jaxpar.parse_hardware(str(path))


def test_a_step_of_known_fixed_cost_and_utilisation_is_recovered():
    def t(p, c):
        return 1e-3 + p / 0.25 + c

    fitted = model_step.least_squares_step([(1e-4, 2e-4, t(1e-4, 2e-4)), (4e-4, 2e-4, t(4e-4, 2e-4))])
    assert math.isclose(fitted["utilisation"], 0.25, rel_tol=1e-9) and math.isclose(fitted["fixed"], 1e-3, rel_tol=1e-9)
    assert fitted["note"] == ""
    # a step that does not grow with its FLOPs: utilisation 1, everything else is the fixed cost
    flat = model_step.least_squares_step([(1e-5, 0.0, 2e-3), (4e-5, 0.0, 1.9e-3)])
    assert flat["utilisation"] == 1.0 and math.isclose(flat["fixed"], 1.95e-3 - 2.5e-5, rel_tol=1e-9)
    assert "did not grow with its FLOPs" in flat["note"]
    # more compute than the time allows: fixed cost 0, said
    assert "taken as 0" in model_step.least_squares_step([(1e-3, 0.0, 2e-3), (2e-3, 0.0, 5e-3)])["note"]


def test_a_noisy_step_is_fitted_over_several_batches_and_the_fits_error_is_reported():
    """Five batches on a machine whose step is 1 ms + P / 0.25 + C with a known +-3% error on each: the least-squares
    line gives u and the fixed cost within a few percent, and the fit's residuals are reported exactly."""
    import numpy as np

    p = np.array([1e-4, 2e-4, 4e-4, 8e-4, 16e-4])
    noise = np.array([0.03, -0.03, 0.03, -0.03, 0.0])
    t = (1e-3 + p / 0.25 + 2e-4) * (1 + noise)
    fitted = model_step.least_squares_step(list(zip(p, [2e-4] * 5, t)))
    assert abs(fitted["utilisation"] / 0.25 - 1) < 0.03 and abs(fitted["fixed"] / 1e-3 - 1) < 0.1, fitted
    slope, intercept = np.polyfit(p, t - 2e-4, 1)
    relative = (intercept + slope * p + 2e-4 - t) / t
    assert math.isclose(fitted["rms_relative_error"], float(np.sqrt(np.mean(relative ** 2))), rel_tol=1e-9)
    assert math.isclose(fitted["worst_relative_error"], float(np.max(np.abs(relative))), rel_tol=1e-9)
    assert 0.01 < fitted["rms_relative_error"] < 0.04


def test_codecs_are_calibrated_per_element_on_a_fake_machine_and_the_profile_keeps_them(tmp_path):
    """A fake machine where int8's encode + decode of the timed shape takes 20 ms and bf16's 1 ms: the profile
    stores seconds per element, survives the JSON round trip, and prices a codec's compute from it."""
    from jaxpar.calibration import codecs as codec_calibration
    from jaxpar.cost import codecs
    from jaxpar.parallel.compression import parse_codec

    elements = codec_calibration.ELEMENTS
    found = machine.calibrate(MESH, measure=_known_machine(7e-6, 3e9), flops=2.5e10, codecs=("bf16", "int8"),
                              measure_codec=lambda name, n: {"bf16": 1e-3, "int8": 2e-2}[name])
    assert found["codecs"]["int8"] == {"seconds_per_element": 2e-2 / elements, "flops_per_element": 15 + 11 / 8,
                                         "replicas": 8}
    assert found["codecs"]["bf16"]["seconds_per_element"] == 1e-3 / elements
    assert any("codec int8 (N=8)" in line for line in machine.summary(found))
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(found))
    loaded = jaxpar.parse_hardware(str(path))
    assert loaded.codecs == found["codecs"]
    int8 = parse_codec("int8")
    # at the calibrated N: the measured time per element; at N = 2 scaled by the FLOPs (15 + 11/N per element)
    assert math.isclose(codecs.compute_seconds(int8, [(1024,)], 8, loaded), 1024 * 2e-2 / elements, rel_tol=1e-12)
    assert math.isclose(codecs.compute_seconds(int8, [(1024,)], 2, loaded), 1024 * 2e-2 / elements * 20.5 / 16.375,
                        rel_tol=1e-12)
    # a codec not calibrated (fp16) is priced by its FLOPs at the sustained rate, as before
    fp16 = parse_codec("fp16")
    assert codecs.compute_seconds(fp16, [(1024,)], 8, loaded) == 7 * 1024 / loaded.compute_flops


def test_a_malformed_codecs_entry_is_refused_in_one_line(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"name": "p", "flops": 1e9, "links": {"data": {"alpha": 0, "bandwidth": 1e9}},
                                "codecs": {"int8": {"seconds_per_element": 1e-9}}}))
    with pytest.raises(jaxpar.JaxparError, match="'codecs' must map codec names to"):
        jaxpar.parse_hardware(str(path))
    path.write_text(json.dumps({"name": "p", "flops": 1e9, "links": {"data": {"alpha": 0, "bandwidth": 1e9}},
                                "codecs": {"int8": {"seconds_per_element": -1, "flops_per_element": 34,
                                                    "replicas": 8}}}))
    with pytest.raises(jaxpar.JaxparError, match="codecs.int8.seconds_per_element must be a finite number > 0"):
        jaxpar.parse_hardware(str(path))


def test_a_codec_is_timed_on_the_devices():
    from jaxpar.calibration import codecs as codec_calibration

    timed = codec_calibration.calibrate_codecs(jaxpar.make_mesh("8"), ("bf16", "powersgd:4"), trips=2, repeats=1)
    for name in ("bf16", "powersgd:4"):
        assert 1e-13 < timed[name]["seconds_per_element"] < 1e-5, timed
    assert timed["powersgd:4"]["flops_per_element"] == 6 * 4 + 2 + 4 * 4 ** 2 / 512  # 6R + 2 + the QR's 4R^2/m


@pytest.mark.slow
def test_a_models_step_is_calibrated_on_a_fake_machine_and_projects_what_was_measured():
    """The reference runs are timed by a fake machine whose step costs exactly fixed + P / u + C: the calibration
    recovers u and the fixed cost, and the profile it writes projects the reference's measured time."""
    machine_profile = machine.calibrate(MESH, measure=_known_machine(7e-6, 3e9), flops=2.5e10)
    seen = []

    def timer(trainer, batch):
        compute, comm = model_step.projected_parts(trainer, batch, Profile.from_dict(machine_profile))
        seen.append(2e-3 + compute / 0.2 + comm)
        return seen[-1]

    profile = calibrate_model(machine_profile, "mlp", 16, timer=timer)
    assert profile["model"] == "mlp" and profile["name"] == "calibrated-mlp"
    assert math.isclose(profile["sustained"], 0.2 * 2.5e10, rel_tol=1e-6)
    assert math.isclose(profile["launch"], 2e-3, rel_tol=1e-6)
    assert [p["batch"] for p in profile["calibration"]["model"]["points"]] == [16, 32, 64, 128, 256]
    assert profile["calibration"]["model"]["rms_relative_error"] < 1e-6  # the fake machine is exactly on the line
    priced = Profile.from_dict(profile)
    import models
    from jaxpar.cli.build import make_optimizer
    from jaxpar.cli.config import Config

    config = Config(model="mlp", dropout=0.0, batch_size=64).resolved()
    trainer = jaxpar.Trainer(models.factory(config), models.loss_for(config), make_optimizer(config, config.lr),
                             jaxpar.make_mesh("8"))
    batch = {"image": jax_struct((64, 8, 8, 1), "float32"), "label": jax_struct((64,), "int32")}
    compute, comm = model_step.projected_parts(trainer, batch, priced)  # compute without the launch
    assert math.isclose(priced.launch + compute + comm, seen[2], rel_tol=1e-6)  # the reference at 64, projected back


@pytest.mark.slow
def test_a_reference_batch_larger_than_the_dataset_is_timed_on_synthetic_batches():
    """--model mlp --batch-size 256: the reference reaches 16 x 256 = 4,096 rows, more than the 1,497 of the digits
    training split; the batches are synthetic, of the model's shapes, so every size is measured."""
    machine_profile = machine.calibrate(MESH, measure=_known_machine(7e-6, 3e9), flops=2.5e10)
    shapes = []

    def timer(trainer, batch):
        shapes.append({k: (v.shape, str(v.dtype)) for k, v in batch.items()})
        compute, comm = model_step.projected_parts(trainer, batch, Profile.from_dict(machine_profile))
        return 1e-3 + compute / 0.5 + comm

    profile = calibrate_model(machine_profile, "mlp", 256, timer=timer)
    assert [p["batch"] for p in profile["calibration"]["model"]["points"]] == [256, 512, 1024, 2048, 4096]
    assert shapes[-1] == {"image": ((4096, 8, 8, 1), "float32"), "label": ((4096,), "int32")}
    assert math.isclose(profile["sustained"], 0.5 * 2.5e10, rel_tol=1e-6)


def test_a_synthetic_batch_draws_its_rows_from_a_real_one():
    import numpy as np

    from jaxpar.calibration.model import synthetic_batches

    example = {"x": np.arange(12, dtype=np.float32).reshape(4, 3), "y": np.array([7, 8, 9, 6], np.int32)}
    batch = synthetic_batches(example)(10)
    assert batch["x"].shape == (10, 3) and batch["y"].dtype == np.int32
    rows = {tuple(r) + (int(y),) for r, y in zip(example["x"], example["y"])}
    assert {tuple(r) + (int(y),) for r, y in zip(batch["x"], batch["y"])} <= rows  # whole rows, labels kept
    assert np.array_equal(synthetic_batches(example)(10)["y"], batch["y"])  # the same draw every time (seed 0)


def test_an_existing_file_that_is_not_a_profile_is_refused_and_left_as_it_was(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    code = cli.main(["--out", str(notes), "--mesh", "2x4", "--sizes", "4096,65536", "--matmul-sizes", "64",
                     "--repeats", "1", "--trips", "2", "--codecs", "none"])
    assert code == 2 and notes.read_text() == "my notes\n" and os.listdir(tmp_path) == ["notes.txt"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m jaxpar.calibrate: error: --out {str(notes)!r}: exists and is not a hardware profile "
                   f"(JSON, as this command writes); pass a new file name, or delete the file first"]
    # a profile (or an empty file) may be replaced: nothing but an old profile is lost
    profile = tmp_path / "old.json"
    from jaxpar.cost.builtin_profiles import PROFILES
    from jaxpar.cost.profile_json import save_profile

    save_profile(PROFILES["a100-nvlink"], profile)
    (tmp_path / "empty.json").write_text("")
    assert cli.out_problem(str(profile)) is None and cli.out_problem(str(tmp_path / "empty.json")) is None
    (tmp_path / "other.json").write_text('{"steps": 3}')
    assert "is not a hardware profile" in cli.out_problem(str(tmp_path / "other.json"))


@pytest.mark.slow
def test_without_a_mesh_a_cpu_machine_gets_the_devices_run_py_makes(tmp_path):
    """No --mesh and no CPU device count chosen: the command makes as many CPU devices as run.py's default --mesh
    (2x4: 8) and measures them all on data. `python -m jaxpar.calibration` is the same command."""
    out = tmp_path / "machine.json"
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-m", "jaxpar.calibrate", "--out", str(out), "--sizes", "4096,65536",
                             "--matmul-sizes", "64", "--repeats", "1", "--trips", "2", "--codecs", "none"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(out.read_text())["calibration"]["mesh"] == {"data": 8, "stage": 1, "fsdp": 1, "seq": 1, "model": 1}
    usage = [subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300) for module in ("jaxpar.calibrate", "jaxpar.calibration")]
    assert [u.returncode for u in usage] == [0, 0] and "--sizes" in usage[0].stdout
    assert usage[0].stdout == usage[1].stdout


@pytest.mark.slow
def test_one_device_is_refused_without_suggesting_a_mesh_of_one():
    result = subprocess.run([sys.executable, "-m", "jaxpar.calibrate", "--codecs", "none"], cwd=ROOT,
                            env=child_env(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
                                          XLA_FLAGS="--xla_force_host_platform_device_count=1"),
                            capture_output=True, text=True, timeout=300)
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(err) == 1, result.stderr[-2000:]
    assert "no axis has more than one device" in err[0] and "JAX has 1 device here" in err[0]
    assert "--mesh 1" not in err[0]


def jax_struct(shape, dtype):
    import jax
    import numpy as np

    return jax.ShapeDtypeStruct(shape, np.dtype(dtype))


@pytest.mark.parametrize("argv, needle", [
    (["--model", "resnet"], "--model 'resnet': not a built-in model; choose one of"),
    (["--batch-size", "8"], "--batch-size 8: applies only with --model"),
    (["--model", "mlp", "--batch-size", "0"], "--batch-size 0: give an integer >= 1"),
])
def test_a_bad_model_argument_is_one_line_and_exit_2(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_trips_lost_in_the_noise_give_an_upper_bound_not_an_absurd_rate(monkeypatch):
    """Measured under load: a 64 x 64 matmul's 1 + 2 trips once took no longer than 1 trip, and the old clamp gave
    1e18 FLOP/s. Now the longer call over its trips bounds a trip from above; real trips still give the difference."""
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def fake(launch, per_trip):
        def build(k):
            def call(x):
                now[0] += launch + k * per_trip
                return x
            return call
        return build

    assert timing.time_loop(fake(2e-3, 0.0), (0.0,), trips=2, repeats=2) == pytest.approx(2e-3 / 3)
    assert timing.time_loop(fake(2e-3, 1e-8), (0.0,), trips=2, repeats=2) == pytest.approx((2e-3 + 3e-8) / 3)
    assert timing.time_loop(fake(2e-3, 1e-4), (0.0,), trips=2, repeats=2) == pytest.approx(1e-4)
