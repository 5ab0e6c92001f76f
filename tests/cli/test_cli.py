import json
import os
import subprocess
import sys

import pytest

import run
from tests.helpers import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(*args, env_extra=None):
    env = child_env()  # run.py must provide the CPU devices itself
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_cli_trains_the_transformer_on_a_2x4_mesh_and_writes_jsonl(tmp_path):
    metrics = tmp_path / "m.jsonl"
    done = cli("--mesh", "2x4", "--steps", "4", "--log-every", "2", "--metrics", str(metrics))
    assert done.returncode == 0, done.stderr
    assert "on mesh data=2 x stage=1 x fsdp=1 x seq=1 x model=4 (8 cpu devices)" in done.stdout
    assert "step 4/4" in done.stdout and "held-out at step 4:" in done.stdout
    config, *records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert config["mesh"] == "2x4" and config["steps"] == 4 and config["layers"] == 2 and config["hidden"] is None
    assert set(config["versions"]) == {"jaxpar", "jax", "flax", "optax"} and config["versions"]["jax"]
    assert [r["step"] for r in records] == [1, 2, 4, 4]
    assert all({"loss", "samples_per_sec", "accuracy"} <= set(r) for r in records[:3])
    assert "eval_perplexity" in records[3]


@pytest.mark.slow
def test_cli_mesh_that_cannot_fit_the_user_chosen_devices_fails_in_one_line():
    done = cli("--mesh", "4x4", env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert done.returncode == 2
    assert done.stderr.strip() == ("run.py: error: --mesh '4x4' needs 16 devices but only 8 are available; "
                                   "try --mesh 2x4")
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.slow
def test_cli_strategy_run_logs_simulated_time_and_staleness(tmp_path, capsys):
    metrics = tmp_path / "ssp.jsonl"
    assert run.main(["--mesh", "4x2", "--model", "mlp", "--strategy", "ssp", "--staleness", "1", "--stragglers",
                     "3:3.0", "--steps", "6", "--log-every", "1", "--metrics", str(metrics)]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()][1:7]
    assert [r["sim_time"] for r in records] == [1.0, 3.0, 4.0, 6.0, 7.0, 9.0]
    assert max(r["staleness_max"] for r in records) == 1.0
    assert "strategy ssp" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_eval_every_logs_held_out_metrics_and_large_batch_flags_take_effect(tmp_path):
    metrics = tmp_path / "m.jsonl"
    assert run.main(["--mesh", "4x2", "--model", "cnn", "--steps", "6", "--eval-every", "3", "--log-every", "1",
                     "--batch-ramp", "32:0,64:3", "--lr-scaling", "linear", "--warmup-steps", "2", "--bn", "local",
                     "--label-smoothing", "0.1", "--grad-accum", "2", "--metrics", str(metrics)]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()][1:]
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [3, 6]
    steps = {r["step"]: r for r in records if "lr" in r}
    assert steps[1]["lr"] == pytest.approx(3e-3 * 0.5) and steps[2]["lr"] == pytest.approx(3e-3)
    assert steps[4]["batch_size"] == 64 and steps[4]["lr"] == pytest.approx(6e-3)


def test_tiny_held_out_split_is_refused_before_training(tmp_path, capsys):
    text = tmp_path / "small.txt"
    text.write_bytes(bytes(range(256)) * 20)  # 5120 bytes: 38 training windows, 1 validation window
    assert run.main(["--data", str(text), "--mesh", "2x4", "--metrics", str(tmp_path / "m.jsonl")]) == 2
    assert "the held-out split has 1 examples, fewer than the 2 devices the batch is split over" in capsys.readouterr().err
    assert not (tmp_path / "m.jsonl").exists()


@pytest.mark.slow
def test_evaluation_is_not_subject_to_grad_accum(capsys):
    assert run.main(["--model", "mlp", "--mesh", "8", "--steps", "2", "--batch-size", "96", "--grad-accum", "4"]) == 0
    assert "held-out at step 2" in capsys.readouterr().out


@pytest.mark.parametrize("body, message", [
    ("def get_config():\n    return jaxpar.Config(foo=1)", "could not be loaded (TypeError"),
    ("def get_config():\n    return jaxpar.Config(mesh=8)", "--mesh 8: must be a string"),
    ("def get_config():\n    return jaxpar.Config(lr='0.1')", "--lr '0.1': must be a number"),
    ("def get_config():\n    return jaxpar.Config(model='cnn', channels=(16,))",
     "channels (16,): must be two positive integers"),
    ("def get_config():\n    return jaxpar.Config(channels=(16, 32))",
     "channels (16, 32) does not apply to --model transformer; it applies to cnn"),
    ("def get_config():\n    return jaxpar.Config(rules={'mlp': 3})", "rules {'mlp': 3}: must map logical axis"),
    ("x = 1", "defines no get_config()"),
])
def test_bad_config_files_are_one_line_errors(tmp_path, capsys, body, message):
    path = tmp_path / "cfg.py"
    path.write_text("import jaxpar\n" + body + "\n")
    assert run.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.slow
def test_large_digits_batch_still_evaluates_the_whole_test_split(capsys):
    assert run.main(["--model", "mlp", "--mesh", "8", "--steps", "2", "--batch-size", "512", "--optimizer",
                     "momentum", "--lr", "0.05"]) == 0
    assert "held-out at step 2: accuracy" in capsys.readouterr().out


@pytest.mark.slow
def test_config_preset_with_flag_override(tmp_path, capsys):
    assert run.main(["--config", os.path.join(ROOT, "configs", "mlp.py"), "--steps", "3", "--log-every", "1"]) == 0
    out = capsys.readouterr().out
    assert "jaxpar: mlp" in out and "on mesh data=8 x stage=1 x fsdp=1 x seq=1 x model=1" in out and "step 3/3" in out


@pytest.mark.parametrize("args, message", [
    (["--steps", "-5"], "--steps -5: must be an integer >= 1"),
    (["--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
    (["--lr", "0"], "--lr 0.0: must be > 0"),
    (["--model", "resnet"], "--model 'resnet' is not a model; choose one of transformer, mlp, cnn"),
    (["--config", "configs/nope.py"], "--config 'configs/nope.py': no such file; presets: configs/cnn.py"),
    (["--mesh", "2x"], "--mesh '2x': '' is not an axis size"),
    (["--mesh", "4x2", "--batch-size", "30"], "--batch-size 30 does not divide by the 4 devices the batch is split "
                                              "over (data x fsdp of --mesh 4x2); use a multiple of 4, e.g. --batch-size 28"),
    (["--mesh", "4x4"], "--mesh '4x4' needs 16 devices but only 8 are available; try --mesh 2x4"),
    (["--data", "/no/such/corpus"], "--data '/no/such/corpus': no such file or folder"),
    (["--model", "mlp", "--data", "x.txt"], "--data 'x.txt' does not apply to --model mlp; it applies to transformer "
                                            "(mlp and cnn train on the built-in digits dataset)"),
    (["--metrics", "/no/such/dir/m.jsonl"], "--metrics '/no/such/dir/m.jsonl': folder '/no/such/dir' does not exist"),
    (["--model", "mlp", "--batch-size", "4096"], "digits training split has 1497 examples, fewer than one global "
                                                 "batch of 4096; use a global batch (--batch-size / --batch-ramp) of 1497 or less"),
    (["--dropout", "1.5"], "--dropout 1.5: must be in [0, 1)"),
    (["--strategy", "gossip"], "--strategy 'gossip' is not a strategy; choose one of sync, local_sgd, diloco, ssp, asp"),
    (["--allreduce", "tree"], "--allreduce 'tree': is not one of: psum, ring, torus2d, ps"),
    (["--strategy", "local_sgd", "--sync-period", "0"], "--sync-period 0: must be an integer >= 1"),
    (["--strategy", "ssp", "--staleness", "-1"], "--staleness -1: must be an integer >= 0"),
    (["--strategy", "sync", "--staleness", "2"], "--staleness 2 does not apply to --strategy sync; it applies to ssp"),
    (["--strategy", "ssp", "--sync-period", "4"], "--sync-period 4 does not apply to --strategy ssp; it applies to "
                                                  "local_sgd / diloco"),
    (["--strategy", "local_sgd", "--outer-lr", "0.5"], "--outer-lr 0.5 does not apply to --strategy local_sgd"),
    (["--strategy", "diloco", "--outer-momentum", "1.0"], "--outer-momentum 1.0: must be in [0, 1)"),
    (["--torus", "2"], "--torus 2: applies only with --allreduce torus2d"),
    (["--mesh", "8", "--model", "mlp", "--allreduce", "torus2d", "--torus", "3"],
     "--torus 3: does not divide the data axis size 8; use one of: 1, 2, 4, 8"),
    (["--mesh", "4x2", "--strategy", "asp", "--stragglers", "4:2.0"], "--stragglers '4:2.0': replica 4 does not exist"),
    (["--strategy", "asp", "--stragglers", "3:0"], "--stragglers '3:0'"),
    (["--strategy", "asp", "--stragglers", "3:x"], "--stragglers '3:x'"),
    (["--eval-every", "-1"], "--eval-every -1: must be an integer >= 0"),
    (["--seed", "5000000000"], "--seed 5000000000: must be in [0, 2**32)"),
    (["--metrics", "/tmp"], "--metrics '/tmp': not a writable file path"),
    (["--lr-schedule", "step", "--lr-decay-steps", "\u00b2"], "must be increasing step numbers"),
    (["--batch-ramp", "\u00b2:0"], "is not SIZE:FROM_STEP"),
    (["--optimizer", "rmsprop"], "--optimizer 'rmsprop': choose one of adamw, sgd, momentum"),
    (["--model", "mlp", "--mesh", "8", "--steps", "5", "--optimizer", "sgd", "--lr", "1e30", "--on-nonfinite", "abort"],
     "training diverged: loss is nan at step 2; lower --lr"),
    (["--warmup-steps", "2.5"], "argument --warmup-steps: invalid int value: '2.5'"),
    (["--grad-accum", "0"], "--grad-accum 0: must be an integer >= 1"),
    (["--base-batch-size", "0"], "--base-batch-size 0: must be an integer >= 1"),
    (["--lr-scaling", "cubic"], "--lr-scaling 'cubic': choose one of none, linear, sqrt"),
    (["--lr-schedule", "poly"], "--lr-schedule 'poly': choose one of constant, cosine, step"),
    (["--lr-schedule", "step", "--lr-decay-steps", "20,10"], "--lr-decay-steps '20,10': must be increasing"),
    (["--lr-decay-steps", "10"], "--lr-decay-steps applies only to --lr-schedule step"),
    (["--lr-decay-factor", "0"], "--lr-decay-factor 0.0: must be in (0, 1]"),
    (["--dtype", "float16"], "--dtype 'float16': choose one of float32, bfloat16"),
    (["--label-smoothing", "1.0"], "--label-smoothing 1.0: must be in [0, 1)"),
    (["--label-smoothing", "-0.1"], "--label-smoothing -0.1: must be in [0, 1)"),
    (["--bn", "local"], "--bn 'local' does not apply to --model transformer; it applies to cnn (only the cnn has "
                        "BatchNorm)"),
    (["--model", "cnn", "--bn", "global"], "--bn 'global': choose one of sync, local"),
    (["--model", "cnn", "--bn", "sync", "--allreduce", "ring"], "--bn sync needs --strategy sync without --allreduce"),
    (["--batch-ramp", "32:0,16:10"], "--batch-ramp '32:0,16:10': steps and sizes must both increase"),
    (["--mesh", "8", "--model", "mlp", "--batch-ramp", "32:0,36:10"], "--batch-ramp '32:0,36:10': size 36 does not "
                                                                      "divide by the 8 devices the batch is split over"),
    (["--mesh", "2x4", "--grad-accum", "3"], "--grad-accum 3 does not divide the per-replica batch 16"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message, capsys):
    with pytest.raises(SystemExit) if "invalid int" in message else _no_raise() as raised:
        code = run.main(args)
    code = raised.value.code if raised else code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith("run.py: error: ")


class _no_raise:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_empty_data_file_and_nothing_half_written(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    metrics = tmp_path / "m.jsonl"
    assert run.main(["--data", str(empty), "--metrics", str(metrics)]) == 2
    assert "contains no text (0 bytes)" in capsys.readouterr().err
    assert not metrics.exists()


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as raised:
        run.main(["--help"])
    assert raised.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--mesh", "--config", "--model", "--steps", "--batch-size", "--lr", "--seed", "--data", "--metrics",
                 "--log-every"):
        assert flag in out
