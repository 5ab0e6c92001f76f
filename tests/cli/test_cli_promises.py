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


def test_inert_checkpoint_and_skip_settings_get_a_note(capsys):
    assert run.main(["--model", "mlp", "--mesh", "8", "--steps", "2", "--checkpoint-every", "5",
                     "--on-nonfinite", "abort", "--max-skips", "3"]) == 0
    out = capsys.readouterr().out
    assert "jaxpar: note: --checkpoint-every 5 without --checkpoint-dir: no checkpoint is saved" in out
    assert "jaxpar: note: --max-skips 3 with --on-nonfinite abort" in out


def test_settings_that_act_get_no_note(tmp_path):
    from jaxpar.cli.notes import run_notes

    config = Config(model="mlp", steps=2, checkpoint_every=5, checkpoint_dir=str(tmp_path / "c"),
                           max_skips=3)
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
def test_a_built_in_model_names_what_its_batch_lacks(model, batch, message):
    config = Config(model=model, seq_len=16 if model == "transformer" else None)
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
