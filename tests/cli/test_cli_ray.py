"""`--runtime ray` on the command line: bad input is one line and exit 2 before any process starts; `--explain`
says the workers, their devices, the bytes per push and pull and the emulator's projection; a short run trains
(slow: it starts a local Ray instance)."""

import json
import os
import subprocess
import sys

import pytest

import run
from tests.helpers import child_env

ASP = ["--model", "mlp", "--strategy", "asp", "--runtime", "ray", "--steps", "5"]


def fails(argv, capsys, contains: str) -> None:
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("run.py: error: ") and contains in err, err


def test_ray_flags_are_checked_before_anything_starts(capsys, tmp_path):
    fails(ASP + ["--mesh", "data=1,model=2"], capsys, "--mesh data=1,model=2: the data axis is 1, and --runtime ray")
    fails(ASP + ["--mesh", "-1"], capsys, "give every axis's size with --runtime ray")
    fails(["--model", "mlp", "--mesh", "data=2", "--ray-address", "x:1"], capsys,
          "--ray-address 'x:1': applies only with --runtime ray")
    fails(["--model", "mlp", "--mesh", "data=2", "--server-shards", "2"], capsys,
          "--server-shards 2: applies only with --runtime ray")
    fails(ASP + ["--mesh", "data=2", "--server-shards", "40"], capsys,
          "server_shards 40: the model has 4 parameter arrays, fewer than the shards to split them over")
    fails(ASP + ["--mesh", "data=2", "--hardware", "a100-nvlink"], capsys,
          "--hardware 'a100-nvlink': not supported with --runtime ray")
    fails(ASP + ["--mesh", "data=2", "--ray-address", "127.0.0.1:9"], capsys,
          "--ray-address '127.0.0.1:9': nothing answers there within 10 s")
    fails(["--model", "mlp", "--strategy", "local_sgd", "--local-after", "3", "--runtime", "ray", "--mesh", "data=2"],
          capsys, "--local-after 3: not supported with --runtime ray")
    fails(ASP + ["--mesh", "data=2", "--checkpoint-dir", str(tmp_path / "none"), "--resume", "required"], capsys,
          "holds no server checkpoint to resume (--resume required)")
    assert not (tmp_path / "none").exists()


def test_explain_shows_workers_devices_and_bytes(capsys):
    assert run.main(ASP + ["--mesh", "data=2,model=2", "--explain", "--stragglers", "1:3.0"]) == 0
    out = capsys.readouterr().out
    assert "runtime ray: 2 workers (ReplicaWorker actors), each on mesh data=1,stage=1,fsdp=1,seq=1,model=2 (2 devices)" in out
    assert "each push sends" in out and "emulator's projection" in out and "ratio 0.267" in out  # 5 pushes by t = 4; BSP 3 each
    assert run.main(ASP + ["--mesh", "data=2", "--explain", "--server-shards", "2"]) == 0
    assert "split over 2 ParameterServerShard actors by bytes" in capsys.readouterr().out


@pytest.mark.slow
def test_a_short_asp_run_on_ray_trains_and_writes_its_records(tmp_path):
    metrics = tmp_path / "run.jsonl"
    done = subprocess.run([sys.executable, "run.py", *ASP, "--mesh", "data=2", "--steps", "8", "--metrics",
                           str(metrics), "--stragglers", "1:2.0", "--tensorboard", str(tmp_path / "tb")], capture_output=True, text=True, env=child_env(),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[0]["runtime"] == "ray" and [r["step"] for r in records[1:]] == list(range(1, 9)) + [8]
    assert all("wall_time" in r and "staleness_max" in r for r in records[1:-1])
    assert (tmp_path / "run-ray" / "worker-1.jsonl").exists() and "versions/s" in done.stdout
    assert "held-out at step 8: accuracy" in done.stdout and "eval_loss" in records[-1]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))


@pytest.mark.slow
def test_the_held_out_evaluation_of_a_sync_run_on_ray_is_the_emulated_runs(tmp_path, capsys):
    """Sync through the server is BSP, sync SGD: the server's final parameters, evaluated on the held-out split at
    the end, give the emulated sync run's held-out metrics (float32, different XLA programs)."""
    common = ["--model", "mlp", "--mesh", "data=2", "--strategy", "sync", "--steps", "4", "--log-every", "1",
              "--dropout", "0"]  # (on ray each worker draws its own dropout masks, emulated the global batch's)
    results = {}
    for runtime in ("emulated", "ray"):
        assert run.main([*common, "--runtime", runtime, "--metrics", str(tmp_path / f"{runtime}.jsonl")]) == 0
        records = [json.loads(line) for line in (tmp_path / f"{runtime}.jsonl").read_text().splitlines()]
        results[runtime] = [r for r in records if "eval_loss" in r][-1]
    assert results["ray"]["step"] == results["emulated"]["step"] == 4
    assert abs(results["ray"]["eval_loss"] - results["emulated"]["eval_loss"]) < 1e-4
    assert results["ray"]["eval_accuracy"] == results["emulated"]["eval_accuracy"]
    assert "held-out at step 4: accuracy" in capsys.readouterr().out
