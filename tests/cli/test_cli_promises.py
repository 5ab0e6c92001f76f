"""Promises the CLI makes and once broke: nothing written before every check passed, --explain writes nothing,
outputs never inside --data, no silently empty path, no silently inert setting, and the built-in models' batch
errors said in one line (through `jaxpar.Trainer`)."""

import os

import numpy as np
import optax
import pytest

import jaxpar
import models
import run
from jaxpar.cli import Config


def refused(args, capsys) -> str:
    """run.py's one error line for `args` (exit code 2)."""
    assert run.main(args) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("run.py: error: "), captured.err
    assert "Traceback" not in captured.out + captured.err
    return captured.err


def outputs(tmp_path) -> tuple[list[str], dict]:
    """(the flags of every output a run writes, their paths), all inside tmp_path and not there yet."""
    paths = {"tensorboard": tmp_path / "tb", "metrics": tmp_path / "m.jsonl", "checkpoints": tmp_path / "ckpt"}
    return (["--tensorboard", str(paths["tensorboard"]), "--metrics", str(paths["metrics"]), "--checkpoint-dir",
             str(paths["checkpoints"])], paths)


@pytest.mark.parametrize("args, message", [
    (["--model", "mlp", "--mesh", "8", "--batch-size", "15"], "--batch-size 15 does not divide by the 8 devices"),
    # found only once the model is placed on the mesh, after the data is read
    (["--model", "mlp", "--mesh", "1x3"], "--hidden 128 does not divide by the model axis of size 3"),
])
def test_a_refused_run_writes_nothing(tmp_path, capsys, args, message):
    flags, paths = outputs(tmp_path)
    assert message in refused(args + flags, capsys)
    assert sorted(os.listdir(tmp_path)) == [], "a refused run created " + ", ".join(os.listdir(tmp_path))


def test_a_refused_run_adds_no_event_file_to_an_existing_tensorboard_folder(tmp_path, capsys):
    board = tmp_path / "tb"
    board.mkdir()
    (board / "earlier").write_text("")
    refused(["--model", "mlp", "--mesh", "8", "--batch-size", "15", "--tensorboard", str(board)], capsys)
    assert os.listdir(board) == ["earlier"]


@pytest.mark.slow
def test_explain_writes_nothing(tmp_path, capsys):
    flags, paths = outputs(tmp_path)
    assert run.main(["--model", "mlp", "--mesh", "8", "--explain", *flags]) == 0
    assert "collectives" in capsys.readouterr().out.lower()
    assert os.listdir(tmp_path) == [], "--explain created " + ", ".join(os.listdir(tmp_path))


@pytest.mark.parametrize("flag", ["--tensorboard", "--metrics", "--checkpoint-dir"])
def test_no_output_inside_the_data_folder(tmp_path, capsys, flag):
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("some text " * 1000)
    inside = str(text / "out")
    err = refused(["--data", str(text), flag, inside], capsys)
    assert f"{flag} {inside!r}: is --data {str(text)!r} or inside it" in err
    assert os.listdir(text) == ["a.txt"]


def test_an_empty_hardware_profile_is_refused(capsys):
    err = refused(["--model", "mlp", "--hardware", ""], capsys)
    assert "--hardware '': empty" in err and "--hardware a100-nvlink" in err


@pytest.mark.slow
def test_inert_checkpoint_and_skip_settings_get_a_note(capsys):
    assert run.main(["--model", "mlp", "--mesh", "8", "--steps", "2", "--checkpoint-every", "5",
                     "--on-nonfinite", "abort", "--max-skips", "3"]) == 0
    out = capsys.readouterr().out
    assert "jaxpar: note: --checkpoint-every 5 without --checkpoint-dir: no checkpoint is saved" in out
    assert "jaxpar: note: --max-skips 3 with --on-nonfinite abort" in out


def test_settings_that_act_get_no_note(tmp_path):
    from jaxpar.cli.notes import run_notes

    config = Config(model="mlp", steps=2, checkpoint_every=5, checkpoint_dir=str(tmp_path / "c"), max_skips=3)
    assert run_notes(config) == []


def trainer_for(config):
    return jaxpar.Trainer(model=models.factory(config), loss_fn=models.loss_for(config), optimizer=optax.sgd(0.1),
                          mesh=jaxpar.make_mesh("8"))


@pytest.mark.parametrize("model, batch, message", [
    ("mlp", {"image": np.zeros((8, 8, 8, 1), np.float32), "label": np.zeros(8, np.float32)},
     "batch['label']: got float32 [8]; the mlp model needs integer [B]"),
    ("cnn", {"image": np.zeros((8, 64), np.float32), "label": np.zeros(8, np.int32)},
     "batch['image']: got float32 [8, 64]; the cnn model needs floating [B, H, W, 1]"),
    ("transformer", {"text": np.zeros((8, 17), np.int32)},
     "batch has no 'tokens' key (it has 'text'); the transformer model needs batch['tokens']: integer [B, L + 1]"),
    ("transformer", {"tokens": np.zeros((8, 40), np.int32)},
     "batch['tokens']: got int32 [8, 40]; the transformer model needs integer [B, L + 1] with 1 <= L <= seq_len 16"),
])
@pytest.mark.slow
def test_a_built_in_model_names_what_its_batch_lacks(model, batch, message):
    config = (Config(model=model, seq_len=16, layers=1, d_model=32, heads=4, d_ff=64) if model == "transformer"
              else Config(model=model))  # a one-block transformer: the layout check does not need the default
    trainer = trainer_for(config)
    state = trainer.init(0)
    with pytest.raises(jaxpar.DataError) as raised:
        trainer.step(state, batch)
    assert message in str(raised.value)
    good = {"mlp": {"image": np.zeros((8, 8, 8, 1), np.float32), "label": np.zeros(8, np.int32)},
            "cnn": {"image": np.zeros((8, 8, 8, 1), np.float32), "label": np.zeros(8, np.int32)},
            "transformer": {"tokens": np.zeros((8, 17), np.int32)}}[model]
    _, metrics = trainer.step(state, good)  # the same trainer takes a batch of the right layout
    assert np.isfinite(float(metrics["loss"]))


# --- --profile-dir is checked with the other paths, before anything is written ---------------------------------------
TRACE_INTO_A_FILE = "'tb/plugins' is a regular file, not a folder (the trace is written into 'tb/plugins/profile')"


@pytest.mark.parametrize("flags, unusable, message", [
    (["--profile-dir", "tb"], "tb/plugins", f"--profile-dir 'tb': {TRACE_INTO_A_FILE}; pass another folder such as "
                                            f"profile/"),
    (["--tensorboard", "tb"], "tb/plugins", f"--profile 1:2: its default --profile-dir 'tb': {TRACE_INTO_A_FILE}; "
                                            f"pass another folder such as --profile-dir traces/"),
    (["--profile-dir", "tb"], "tb", "--profile-dir 'tb': is a regular file, not a folder; pass a folder such as "
                                    "profile/"),
])
def test_an_unusable_profile_dir_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, flags,
                                                                        unusable, message):
    monkeypatch.chdir(tmp_path)
    if unusable != "tb":
        (tmp_path / "tb").mkdir()
    (tmp_path / unusable).write_text("keep")
    before = sorted(tmp_path.rglob("*"))
    err = refused(["--model", "mlp", "--mesh", "8", "--steps", "3", "--profile", "1:2", "--metrics", "m.jsonl",
                   *flags], capsys)
    assert err == f"run.py: error: {message}\n"
    assert sorted(tmp_path.rglob("*")) == before  # no metrics file, no trace folder


def test_a_profile_dir_that_takes_no_new_folder_is_refused(tmp_path, monkeypatch, capsys):
    """A folder that looks writable but is not (a read-only file system; one that even root may not write): the
    folders the trace needs are probed, and the probe leaves nothing behind."""
    from jaxpar.cli import paths

    def read_only(**kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(paths.tempfile, "mkdtemp", read_only)
    err = refused(["--model", "mlp", "--profile", "1:2", "--profile-dir", str(tmp_path / "t"), "--metrics",
                   str(tmp_path / "m.jsonl")], capsys)
    assert err == (f"run.py: error: --profile-dir {str(tmp_path / 't')!r}: cannot create folders in "
                   f"{str(tmp_path)!r} (Operation not permitted); pass a writable folder such as profile/\n")
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    assert paths.trace_folder("profile/")("--profile-dir", str(tmp_path / "t")) is None
    assert os.listdir(tmp_path) == []  # the probe's folder is gone


# --- options that cannot act are one note each ------------------------------------------------------------------------
@pytest.mark.parametrize("flags, note", [
    (["--profile", "50:60", "--steps", "10"], "--profile 50:60 starts at step 50, at or after --steps 10: no step is "
                                              "traced"),
    (["--profile", "5:20", "--steps", "10"], "--profile 5:20 stops at step 20, after --steps 10: the trace covers the "
                                             "steps from 5 to 10"),
    (["--profile", "1:2", "--explain"], "--profile 1:2 with --explain: nothing trains, so nothing is traced"),
    (["--profile", "2:4", "--steps", "10"], None),
    (["--profile", "0:10", "--steps", "10"], None),
])
def test_a_profile_with_nothing_to_trace_is_a_note(flags, note):
    from jaxpar.cli.notes import run_notes

    assert run_notes(run.parse(["--model", "mlp", *flags])) == ([note] if note else [])


def test_metrics_with_plan_is_a_note(tmp_path, monkeypatch, capsys):
    from jaxpar.cli import planning

    monkeypatch.setattr(planning, "plan_run", lambda config: {"plan": "ranked"})  # (ranking the meshes is slow)
    metrics = str(tmp_path / "m.jsonl")
    assert run.main(["--model", "mlp", "--plan", "--hardware", "a100-nvlink", "--metrics", metrics]) == 0
    assert capsys.readouterr().out == (f"jaxpar: note: --metrics {metrics!r} with --plan: nothing trains, so no "
                                       f"metrics file is written\n")
    assert run.main(["--model", "mlp", "--plan", "--hardware", "a100-nvlink"]) == 0
    assert capsys.readouterr().out == ""


def built(argv, params=None):
    """(config, a stand-in for its trainer: mesh, strategy, parameter shapes) without compiling anything."""
    from types import SimpleNamespace

    import jax

    from jaxpar.cli.strategies import from_config

    config = run.parse(argv)
    params = params or {"w": jax.ShapeDtypeStruct((64, 128), np.float32), "b": jax.ShapeDtypeStruct((128,),
                                                                                                     np.float32)}
    return config, SimpleNamespace(mesh=jaxpar.make_mesh(config.mesh), strategy=from_config(config),
                                   ctx=SimpleNamespace(abstract_params=params))


def test_a_stage_axis_that_a_minus_one_makes_1_is_a_note_for_the_pipeline_flags():
    from jaxpar.cli.notes import built_notes, run_notes

    config, trainer = built(["--mesh", "data=8,stage=-1", "--pipeline", "1f1b"])
    assert run_notes(config) == []  # not known from the spec
    assert built_notes(config, trainer) == [
        "--pipeline 1f1b on --mesh data=8,stage=-1, whose stage axis has size 1: nothing is pipelined, the stacked "
        "layers run as one scan (--microbatches still cuts the batch); add e.g. stage=2 to --mesh"]
    assert built_notes(*built(["--mesh", "data=4,stage=-1", "--pipeline", "1f1b"])) == []  # 2 stages
    assert built_notes(*built(["--mesh", "data=8,stage=-1"])) == []  # the default schedule


@pytest.mark.parametrize("argv, note", [
    (["--allreduce", "psum", "--compress", "powersgd:100000", "--mesh", "8"],
     "--compress powersgd:100000: no parameter matrix is larger than its rank-100000 factors ((rows + columns) x "
     "100000 >= rows x columns), so nothing is factorised and every gradient is sent whole; powersgd:42 or a lower "
     "rank factorises at least one"),  # (64 + 128) x 42 < 64 x 128 <= (64 + 128) x 43
    (["--allreduce", "psum", "--compress", "int8", "--mesh", "1x8"],
     "--compress int8 on --mesh 1x8, whose data axis has size 1: no gradient is exchanged over data, so nothing is "
     "compressed on the wire (each update still goes through the codec's rounding)"),
    (["--strategy", "diloco", "--compress", "bf16", "--mesh", "fsdp=8"],
     "--compress bf16 on --mesh fsdp=8, whose data axis has size 1: no gradient is exchanged over data, so nothing "
     "is compressed on the wire (each update still goes through the codec's rounding)"),
    (["--allreduce", "psum", "--compress", "bf16", "--mesh", "fsdp=8"], None),  # sync's fsdp leg takes the codec
    (["--allreduce", "psum", "--compress", "powersgd:42", "--mesh", "8"], None),
    (["--allreduce", "psum", "--compress", "int8", "--mesh", "2x4"], None),
    (["--strategy", "local_sgd", "--mesh", "1x8"], None),  # no codec
])
def test_a_codec_that_compresses_nothing_is_a_note(argv, note):
    from jaxpar.cli.notes import built_notes

    assert built_notes(*built(["--model", "mlp", *argv])) == ([note] if note else [])


def test_a_powersgd_rank_too_large_for_every_matrix_says_so_when_none_could_shrink():
    import jax

    from jaxpar.cli.notes import built_notes

    tiny = {"w": jax.ShapeDtypeStruct((2, 2), np.float32), "b": jax.ShapeDtypeStruct((2,), np.float32)}
    (note,) = built_notes(*built(["--model", "mlp", "--allreduce", "psum", "--compress", "powersgd:1", "--mesh", "8"],
                                 tiny))
    assert note.endswith("every gradient is sent whole; the model has no parameter matrix that a factorisation "
                         "would shrink")


@pytest.mark.slow
def test_the_run_prints_the_codec_note_once(capsys):
    assert run.main(["--model", "mlp", "--mesh", "8", "--steps", "1", "--eval-batches", "0", "--allreduce", "psum",
                     "--compress", "powersgd:100000"]) == 0
    out = capsys.readouterr().out
    assert out.count("jaxpar: note: --compress powersgd:100000: no parameter matrix is larger than its rank-100000 "
                     "factors") == 1
