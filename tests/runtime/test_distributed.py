"""Several processes on loopback (JAX's distributed runtime, gloo): the device order, the launcher, and runs that
must equal the single-process run. The multi-process runs are real processes started by `jaxpar.launch`, each
bounded in time; the single-process references run in this process (8 CPU devices)."""

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

import jaxpar
import run
from jaxpar.runtime import launch
from jaxpar.io.checkpoint import Checkpointer
from jaxpar.parallel.device_grid import device_grid
from jaxpar.parallel.mesh import MeshError, crossing_axes, parse_mesh_spec
from tests.helpers import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--model", "transformer", "--layers", "1", "--d-model", "32", "--heads", "4", "--d-ff", "64", "--seq-len",
        "16", "--batch-size", "16", "--log-every", "1", "--eval-batches", "1", "--dropout", "0.1", "--lr", "0.01"]
LAUNCH_SECONDS = 240  # a bound on each launched run (they take 15-60 s on 2 busy cores)


# --- the device order (no processes needed: devices are described by id and process) ----------------------------
def fake_devices(local=4, processes=2, interleaved=False):
    count = local * processes
    owner = (lambda i: i % processes) if interleaved else (lambda i: i // local)
    return [SimpleNamespace(id=i, process_index=owner(i), platform="cpu") for i in range(count)]


def ids(grid):
    """Device ids of a (data, stage, fsdp, model) grid without stages (a mesh spec that names no stage), as a
    (data, fsdp, model) nested list."""
    assert grid.shape[1] == 1 and grid.shape[3] == 1
    return np.vectorize(lambda d: d.id)(grid[:, 0, :, 0]).tolist()


@pytest.mark.parametrize("spec, expected", [
    ("2x4", [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]),  # a replica per process: model inside it
    ("data=2,fsdp=2,model=2", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]),  # data crosses, fsdp and model inside
    ("fsdp=8", [[[0], [1], [2], [3], [4], [5], [6], [7]]]),  # fsdp 4 inside x 2 across
    ("4x2", [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]),
])
def test_device_order_on_2_processes_of_4_devices(spec, expected):
    grid = device_grid(parse_mesh_spec(spec), fake_devices())
    assert ids(grid) == expected
    crossing = crossing_axes(SimpleNamespace(devices=grid))
    assert "model" not in crossing
    assert crossing == (["fsdp"] if spec == "fsdp=8" else ["data"])


def test_device_order_follows_process_not_id():
    # process 0 owns the even ids, process 1 the odd ones: each data replica still sits inside one process
    grid = device_grid(parse_mesh_spec("2x4"), fake_devices(interleaved=True))
    assert ids(grid) == [[[0, 2, 4, 6]], [[1, 3, 5, 7]]]
    grid = device_grid(parse_mesh_spec("data=2,fsdp=2,model=2"), fake_devices(interleaved=True))
    assert ids(grid) == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]


def test_model_axis_larger_than_a_process_is_reported_as_crossing():
    grid = device_grid(parse_mesh_spec("1x8"), fake_devices())
    assert crossing_axes(SimpleNamespace(devices=grid)) == ["model"]
    grid = device_grid(parse_mesh_spec("2x4"), fake_devices(local=2, processes=4))  # model 4 > 2 per process
    assert sorted(crossing_axes(SimpleNamespace(devices=grid))) == ["data", "model"]


def test_a_mesh_must_use_every_device_of_every_process():
    with pytest.raises(MeshError, match=r"--mesh '2x2' uses 4 of 8 devices, but with 2 processes a mesh must use "
                                        r"every device of every process \(each has 4\); use a mesh of 8 devices"):
        device_grid((2, 1, 1, 2), fake_devices(), "2x2")


def test_one_process_keeps_the_plain_order():
    grid = device_grid(parse_mesh_spec("2x2"), fake_devices(local=8, processes=1))
    assert ids(grid) == [[[0, 1]], [[2, 3]]]


# --- the launcher's pieces ---------------------------------------------------------------------------------------
def test_child_environment_replaces_the_inherited_device_count():
    env = launch.child_environment(1, 2, 1234, None, base={
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_foo=1", "JAXPAR_LOCAL_DEVICES": "3"})
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1"
    assert (env["JAXPAR_COORDINATOR"], env["JAXPAR_NUM_PROCESSES"], env["JAXPAR_PROCESS_ID"]) == (
        "127.0.0.1:1234", "2", "1")
    assert "JAXPAR_LOCAL_DEVICES" not in env
    assert launch.child_environment(0, 2, 1, 4, base={})["JAXPAR_LOCAL_DEVICES"] == "4"


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "2"], "give the program after --"),
    (["--nproc", "0", "--", "run.py"], "--nproc 0: must be an integer >= 1 (processes)"),
    # the launcher's own port, checked before any process starts (not once per process, as run.py's --coordinator)
    (["--nproc", "2", "--port", "99999", "--", "run.py"], "--port 99999: must be an integer in [1, 65536)"),
    (["--nproc", "2", "--port", "0", "--", "run.py"], "--port 0: must be an integer in [1, 65536)"),
    (["--nproc", "2", "--", "missing.py"], "'missing.py': no such file"),
])
def test_launcher_usage_errors_are_one_line(argv, message, capsys, monkeypatch):
    started = []
    monkeypatch.setattr(launch.Launcher, "start", lambda self: started.append(self))
    with pytest.raises(SystemExit) as stop:
        launch.main(argv)
    assert started == []  # nothing was started
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("args, message", [
    (["--coordinator", "localhost"], "--coordinator 'localhost': must be HOST:PORT"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2"],
     "--process-id None: give --coordinator, --num-processes and --process-id together"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
     "--process-id 2: must be below --num-processes (2)"),
    (["--num-processes", "3", "--process-id", "0", "--coordinator", "127.0.0.1:1"],
     "--mesh 2x4 has 8 devices, which do not divide over --num-processes 3"),
])
def test_process_flag_errors(args, message, capsys):
    assert run.main(["--model", "mlp", "--mesh", "2x4", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err


# --- real processes ----------------------------------------------------------------------------------------------
def launched(nproc, args, timeout=LAUNCH_SECONDS):
    """`python -m jaxpar.launch --nproc N -- run.py ARGS`, waited for; (exit code, stdout, stderr)."""
    env = child_env()
    process = subprocess.run([sys.executable, "-m", "jaxpar.runtime.launch", "--nproc", str(nproc), "--", "run.py", *args],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return process.returncode, process.stdout, process.stderr


def losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(path).read().splitlines()) if "loss" in r and "step" in r}


def final_eval(path) -> dict:
    return [r for r in map(json.loads, open(path).read().splitlines()) if "eval_loss" in r][-1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run (8 devices, 2x4) of 20 steps every multi-process run is compared with."""
    folder = tmp_path_factory.mktemp("reference")
    assert run.main([*TINY, "--mesh", "2x4", "--steps", "20", "--metrics", str(folder / "run.jsonl")]) == 0
    return losses(folder / "run.jsonl"), final_eval(folder / "run.jsonl")


def assert_losses_match(got: dict, expected: dict, steps):
    assert sorted(got) == list(steps)
    np.testing.assert_allclose([got[s] for s in steps], [expected[s] for s in steps], rtol=1e-5)


@pytest.mark.slow
def test_two_processes_with_fsdp_and_tensor_parallel_equal_one_process_and_restore_in_one(reference, tmp_path):
    """The transformer with dropout on data=2,fsdp=2,model=2 over 2 processes (its weights split over fsdp and model,
    so the masks must follow the rows too) gives the losses of the 1-process 2x4 run, and its checkpoint restores in
    1 process on 2x4."""
    expected, _ = reference
    code, out, err = launched(2, [*TINY, "--mesh", "data=2,fsdp=2,model=2", "--steps", "20", "--metrics",
                                  str(tmp_path / "two.jsonl"), "--checkpoint-dir", str(tmp_path / "ck"),
                                  "--checkpoint-every", "10"])
    assert code == 0, err[-3000:]
    assert "[0] jaxpar: transformer" in out and "8 cpu devices in 2 processes, 4 each" in out
    assert not [line for line in out.splitlines() if line.startswith(("[1] step", "[1] jaxpar", "[1] done",
                                                                      "[1] held-out"))]  # process 0 reports
    assert_losses_match(losses(tmp_path / "two.jsonl"), expected, range(1, 21))
    # written by 2 processes, restored in 1: exactly the saved parameters
    trainer = jaxpar.Trainer(**_tiny_trainer_parts(), mesh=jaxpar.make_mesh("2x4"))
    checkpoints = Checkpointer(str(tmp_path / "ck"))
    state, _, _ = checkpoints.restore(trainer)
    saved = checkpoints.arrays(20)
    restored = _flat(trainer.params(state))
    assert restored and all(np.array_equal(value, saved["params." + name + ".value"]) for name, value in
                            restored.items())
    checkpoints.close()  # (a 2-process checkpoint resumed by run.py in 1 process: the killing test below)


def _tiny_trainer_parts(model="transformer"):
    """Model, loss and optimizer of the runs above (`TINY`, or run.py's MLP), for restoring their checkpoints."""
    import optax

    import models
    from jaxpar.cli.config import Config

    config = (Config(model="transformer", layers=1, d_model=32, heads=4, d_ff=64, seq_len=16, dropout=0.1)
              if model == "transformer" else Config(model="mlp")).resolved()
    return dict(model=models.factory(config), loss_fn=models.loss_for(config), optimizer=optax.adamw(0.01))


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(_flat(value, name + ".") if isinstance(value, dict) else {name: value})
    return out


@pytest.mark.slow
def test_local_sgd_resumed_from_one_process_in_two_equals_one_process(tmp_path):
    local = ["--model", "mlp", "--log-every", "1", "--eval-batches", "0", "--lr", "0.01", "--strategy",
             "local_sgd", "--sync-period", "3", "--mesh", "2x4"]
    ck = tmp_path / "ck"
    assert run.main([*local, "--steps", "20", "--metrics", str(tmp_path / "one.jsonl"), "--checkpoint-dir",
                     str(ck), "--checkpoint-every", "10"]) == 0
    expected = losses(tmp_path / "one.jsonl")
    # written by 1 process, restored by 2 through the library (a script of the user's under the launcher):
    # exactly the saved parameters (process 0 gathers them from both processes' shards)
    env = child_env()
    restored = subprocess.run([sys.executable, "-m", "jaxpar.runtime.launch", "--nproc", "2", "--devices-per-process", "4",
                               "--", os.path.join(ROOT, "tests", "distributed_restore.py"), str(ck), "10",
                               str(tmp_path / "params.npz")], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=LAUNCH_SECONDS)
    assert restored.returncode == 0, restored.stderr[-3000:]
    trainer = jaxpar.Trainer(**_tiny_trainer_parts("mlp"), mesh=jaxpar.make_mesh("2x4"),
                             strategy=jaxpar.LocalSGD(period=3))
    checkpoints = Checkpointer(str(ck))
    expected_params = _flat(trainer.params(checkpoints.restore(trainer, 10)[0]))  # the replicas' mean
    checkpoints.close()
    got = dict(np.load(tmp_path / "params.npz"))
    assert sorted(got) == sorted(expected_params)
    assert all(np.array_equal(got[name], expected_params[name]) for name in got)
    # the checkpoint of step 10 continued by 2 processes (step 20 is set aside and made again)
    code, out, err = launched(2, [*local, "--steps", "20", "--metrics", str(tmp_path / "two.jsonl"),
                                  "--checkpoint-dir", str(ck), "--resume", "--resume-step", "10"])
    assert code == 0, err[-3000:]
    got = losses(tmp_path / "two.jsonl")
    assert_losses_match({s: v for s, v in got.items() if s > 10}, expected, range(11, 21))


@pytest.mark.slow
def test_killing_one_process_stops_the_launcher_within_60s_and_leaves_no_process(tmp_path):
    env = child_env()
    process = subprocess.Popen([sys.executable, "-m", "jaxpar.runtime.launch", "--nproc", "2", "--", "run.py", "--model",
                                "mlp", "--mesh", "2x4", "--steps", "100000", "--log-every", "1", "--eval-batches",
                                "0", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2"],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + LAUNCH_SECONDS
        for line in process.stdout:  # until process 0 reports step 3
            if line.startswith("[0] step 3/") or time.monotonic() > deadline:
                break
        while not (tmp_path / "ck" / "2" / "jaxpar_manifest.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # ... and the checkpoint of step 2 is complete
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        assert len(children) == 2
        ranks = {int(open(f"/proc/{p}/environ", "rb").read().split(b"JAXPAR_PROCESS_ID=")[1].split(b"\0")[0]): p
                 for p in children}
        killed = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        code = process.wait(timeout=60)
        elapsed = time.monotonic() - killed
        err = process.stderr.read()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code != 0 and elapsed < 60
    assert "jaxpar.launch: process 1 was killed by SIGKILL; stopping the other processes" in err
    assert "jaxpar.launch: failed: process 1 of 2 was killed by SIGKILL" in err
    for pid in ranks.values():
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    # --resume continues from the last checkpoint (here in one process)
    steps = Checkpointer(str(tmp_path / "ck")).steps()
    assert steps and steps[-1] >= 2
    assert run.main(["--model", "mlp", "--mesh", "2x4", "--steps", str(steps[-1] + 2), "--eval-batches", "0",
                     "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "required"]) == 0


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_process_after_one_agreed_step(tmp_path):
    env = child_env()
    saving = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1000"]
    process = subprocess.Popen([sys.executable, "-m", "jaxpar.runtime.launch", "--nproc", "2", "--", "run.py", "--model",
                                "mlp", "--mesh", "2x4", "--steps", "100000", "--log-every", "1", "--eval-batches",
                                "0", *saving, "--metrics", str(tmp_path / "run.jsonl")],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + LAUNCH_SECONDS
        for line in process.stdout:
            if line.startswith("[0] step 3/") or time.monotonic() > deadline:
                break
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert "jaxpar.launch: SIGTERM: passing SIGTERM to every process" in err
    assert process.returncode == 0, err[-3000:]
    stops = [line for line in err.splitlines() if "run.py: stopped at step" in line]
    assert len(stops) == 2, err[-3000:]  # both processes, after the same step
    step = int(stops[0].split("stopped at step ")[1].split(";")[0])
    assert all(f"stopped at step {step};" in line for line in stops)
    assert Checkpointer(str(tmp_path / "ck")).steps() == [step]
    last = json.loads(open(tmp_path / "run.jsonl").read().splitlines()[-1])
    assert last == {"stopped": f"preempted: checkpoint of step {step} saved"}


def test_settings_come_from_the_launcher_or_the_cluster_environment(monkeypatch):
    from jaxpar.runtime import distributed

    assert distributed.settings_from_environment({}) == {}
    assert distributed.settings_from_environment({"JAXPAR_COORDINATOR": "127.0.0.1:5", "JAXPAR_NUM_PROCESSES": "2",
                                                  "JAXPAR_PROCESS_ID": "1", "JAXPAR_LOCAL_DEVICES": "4"}) == {
        "coordinator": "127.0.0.1:5", "num_processes": 2, "process_id": 1, "local_devices": 4}
    with pytest.raises(jaxpar.ConfigError, match="JAXPAR_PROCESS_ID='x': must be an integer"):
        distributed.settings_from_environment({"JAXPAR_COORDINATOR": "h:1", "JAXPAR_PROCESS_ID": "x"})
    for name in ("SLURM_NTASKS", "SLURM_STEP_ID", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.cluster_detected() is None
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert distributed.cluster_detected() is None  # an allocation, not a job step: one process
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert distributed.cluster_detected() == "SLURM"
    # in this (already started) single process nothing is joined without settings
    monkeypatch.delenv("SLURM_NTASKS")
    assert distributed.initialize() is False
    assert distributed.process_index() == 0 and distributed.is_main() and distributed.lost_processes() == []


# --- the launcher with stand-in programs (no JAX: fast) ----------------------------------------------------------
STAND_IN = """
import os, signal, sys, time
rank = int(os.environ["JAXPAR_PROCESS_ID"])
signal.signal(signal.SIGTERM, lambda *_: (print(f"rank {rank} terminated", flush=True), sys.exit(143)))
open(os.path.join(os.path.dirname(__file__), f"pid{rank}"), "w").write(str(os.getpid()))
print(f"rank {rank} of {os.environ['JAXPAR_NUM_PROCESSES']} at {os.environ['JAXPAR_COORDINATOR']}", flush=True)
if rank == int(sys.argv[1]):
    sys.exit(3)
time.sleep(60)
"""


def run_launcher(tmp_path, fail_rank, signal_after=None):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    process = subprocess.Popen([sys.executable, "-m", "jaxpar.runtime.launch", "--nproc", "3", "--grace", "5", "--",
                                str(script), str(fail_rank)], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if signal_after is not None:
            lines = [process.stdout.readline() for _ in range(3)]  # every rank has started
            assert all(line.startswith("[") for line in lines), lines
            process.send_signal(signal_after)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, out, err


@pytest.mark.slow
def test_launcher_stops_the_others_when_one_process_fails(tmp_path):
    code, out, err = run_launcher(tmp_path, fail_rank=1)
    assert code == 3
    assert "jaxpar.launch: process 1 exited with code 3; stopping the other processes" in err
    assert "jaxpar.launch: failed: process 1 of 3 exited with code 3" in err
    assert "[1] rank 1 of 3 at 127.0.0.1:" in out
    for rank in (0, 2):  # stopped (by SIGTERM, maybe before they even set up), not left running
        pid_file = tmp_path / f"pid{rank}"
        if pid_file.exists():
            pid = int(pid_file.read_text())
            assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()


@pytest.mark.slow
def test_launcher_passes_ctrl_c_as_sigterm_and_reports_a_requested_stop(tmp_path):
    code, out, err = run_launcher(tmp_path, fail_rank=-1, signal_after=signal.SIGINT)
    assert code == 143
    assert "jaxpar.launch: SIGINT: passing SIGTERM to every process" in err
    assert "jaxpar.launch: stopped on request: exit codes [143, 143, 143]" in err
    assert sorted(line for line in out.splitlines() if "terminated" in line) == [
        "[0] rank 0 terminated", "[1] rank 1 terminated", "[2] rank 2 terminated"]


def test_stop_without_a_checkpoint_ends_the_run_as_sigterm_does():
    from jaxpar.train.actions import StopWhen
    from jaxpar.errors import Terminated

    asked = []
    stop = StopWhen(lambda step: asked.append(step) or step == 2, None)
    assert [stop.due(1, False), stop.due(1, False), stop.due(2, False)] == [False, False, True]
    assert asked == [1, 2]  # once per step, whatever the loop asks
    with pytest.raises(Terminated):
        stop(SimpleNamespace(step=2))
