"""Config: one declaration per option -> CLI flags, help, defaults, checks; what applies to which model/strategy."""

import dataclasses
import json

import pytest

import jaxpar
import models
import run
from jaxpar import strategies
from jaxpar.cli import strategies as cli_strategies
from jaxpar.cli.config import OPTIONS, Config
from jaxpar.cli.defaults import MODEL_DEFAULTS
from jaxpar.cli.help import describe
from jaxpar.cli.options import GROUPS
from jaxpar.cli.strategies import APPLIES_TO, NAMES as STRATEGIES
from jaxpar.cli.flags import FLAGS

CONFIG_FILE_ONLY = {"channels", "rules"}


def fails(argv, capsys) -> str:
    """run.main on arguments that must fail validation (so nothing trains): exit code 2, one stderr line."""
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("run.py: error: "), err
    return err


def test_config_lives_in_the_cli_and_the_root_name_still_works():
    import jaxpar.cli

    assert jaxpar.Config is jaxpar.cli.Config is Config and "Config" in jaxpar.__all__
    from jaxpar import Config as from_the_root

    assert from_the_root is Config


# --- one declaration -> flags, help, defaults -------------------------------------------------------------------
def test_generated_flags_match_the_fields_exactly():
    names = [f.name for f in dataclasses.fields(Config)]
    assert [f.option for f in FLAGS] == [n for n in names if n not in CONFIG_FILE_ONLY]
    assert all(f.flag == "--" + f.option.replace("_", "-") for f in FLAGS)
    parser_dests = {a.dest for a in run.parser()._actions} - {"help", "config"}
    assert parser_dests == {f.option for f in FLAGS}
    assert not any(OPTIONS[n].flag for n in CONFIG_FILE_ONLY)


def test_every_option_is_declared_with_help_group_and_a_type_the_flag_parses():
    for f in dataclasses.fields(Config):
        assert OPTIONS[f.name].help and OPTIONS[f.name].group in GROUPS, f.name
    assert {flag.type for flag in FLAGS} <= {int, float, str, bool}
    args = run.parser().parse_args(["--heads", "6", "--lr", "0.5", "--strategy", "ssp"])
    assert (args.heads, args.lr, args.strategy, args.steps, args.explain) == (6, 0.5, "ssp", None, None)
    assert run.parser().parse_args(["--explain"]).explain is True  # a bool flag takes no value


def test_help_and_defaults_come_from_the_declaration(capsys):
    with pytest.raises(SystemExit) as raised:
        run.main(["--help"])
    assert raised.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: run.py")
    squeezed = "".join(out.split())  # argparse wraps lines, also at dashes
    for flag in FLAGS:
        assert flag.flag in out
        assert "".join(flag.help.split()) in squeezed, flag.flag
    plain = {f.name: f.default for f in dataclasses.fields(Config) if f.default is not None}
    for name, default in plain.items():
        if OPTIONS[name].flag:
            assert f"default: {default}" in describe(name), name
    for model, defaults in MODEL_DEFAULTS.items():
        for name, default in defaults.items():
            assert f"{model} only" in describe(name)
            if not callable(default) and OPTIONS[name].default_text is None:
                assert f"default: {default}" in describe(name), name
    assert "default: 4" in describe("sync_period") and "local_sgd / diloco only" in describe("sync_period")
    assert "default: 2" in describe("staleness") and "ssp only" in describe("staleness")
    for form in ("'2x2x2' (data x fsdp x model)", "'data=2,fsdp=2,model=2'", "'fsdp=8'", "-1"):
        assert form in describe("mesh")


def test_strategy_facts_are_read_from_the_strategies_cli_table():
    assert STRATEGIES == tuple(strategies.REGISTRY) == tuple(cls.name for cls in cli_strategies.ADAPTERS)
    for name in strategies.REGISTRY:
        for option in cli_strategies.options_of(name):
            assert name in APPLIES_TO[option]
            assert Config.__dataclass_fields__[option].default is None  # None = "not given"
    assert set(APPLIES_TO) == set(cli_strategies.COMMON_OPTIONS).union(
        *(a.options for a in cli_strategies.ADAPTERS.values()))
    assert APPLIES_TO["sync_period"] == ("local_sgd", "diloco") and APPLIES_TO["staleness"] == ("ssp",)
    assert set(models.MODELS) == set(models.LOSSES)


# --- options that do not apply are errors --------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--model", "mlp", "--heads", "6"], "--heads 6 does not apply to --model mlp; it applies to transformer"),
    (["--model", "cnn", "--seq-len", "8"], "--seq-len 8 does not apply to --model cnn; it applies to transformer"),
    (["--model", "mlp", "--layers", "3"], "--layers 3 does not apply to --model mlp; it applies to transformer"),
    (["--model", "cnn", "--d-model", "64"], "--d-model 64 does not apply to --model cnn; it applies to transformer"),
    (["--model", "mlp", "--d-ff", "64"], "--d-ff 64 does not apply to --model mlp; it applies to transformer"),
    (["--model", "cnn", "--vocab", "512"], "--vocab 512 does not apply to --model cnn; it applies to transformer"),
    (["--model", "transformer", "--hidden", "64"], "--hidden 64 does not apply to --model transformer; it applies "
                                                   "to mlp"),
    (["--model", "cnn", "--hidden", "64"], "--hidden 64 does not apply to --model cnn; it applies to mlp"),
    (["--model", "transformer", "--bn", "local"], "--bn 'local' does not apply to --model transformer; it applies "
                                                  "to cnn"),
    (["--model", "mlp", "--bn", "sync"], "--bn 'sync' does not apply to --model mlp; it applies to cnn"),
    (["--model", "cnn", "--data", "x.txt"], "--data 'x.txt' does not apply to --model cnn; it applies to transformer"),
    (["--staleness", "2"], "--staleness 2 does not apply to --strategy sync; it applies to ssp"),
    (["--strategy", "ssp", "--sync-period", "4"], "--sync-period 4 does not apply to --strategy ssp; it applies to "
                                                  "local_sgd / diloco"),
    (["--strategy", "asp", "--local-after", "1"], "--local-after 1 does not apply to --strategy asp; it applies to "
                                                  "local_sgd / diloco"),
    (["--strategy", "local_sgd", "--outer-lr", "0.5"], "--outer-lr 0.5 does not apply to --strategy local_sgd; it "
                                                       "applies to diloco"),
    (["--strategy", "ssp", "--outer-momentum", "0.5"], "--outer-momentum 0.5 does not apply to --strategy ssp"),
    (["--strategy", "diloco", "--staleness", "0"], "--staleness 0 does not apply to --strategy diloco"),
])
def test_a_flag_for_another_model_or_strategy_is_a_one_line_error(args, message, capsys):
    assert message in fails(args, capsys)


def test_a_config_file_field_for_another_model_is_an_error(tmp_path, capsys):
    path = tmp_path / "cfg.py"
    path.write_text("import jaxpar\ndef get_config():\n    return jaxpar.Config(model='cnn', channels=(8, 16))\n")
    err = fails(["--config", str(path), "--model", "mlp"], capsys)
    assert "channels (8, 16) does not apply to --model mlp; it applies to cnn" in err


def test_not_applicable_is_checked_before_the_value():
    with pytest.raises(jaxpar.ConfigError, match="--heads 0 does not apply to --model mlp"):
        Config(model="mlp", heads=0).validate()
    with pytest.raises(jaxpar.ConfigError, match="--heads 0: must be an integer >= 1"):
        Config(heads=0).validate()


def test_explicit_none_means_not_given_and_a_given_default_is_still_checked_for_applying():
    Config(model="mlp", heads=None).validate()
    with pytest.raises(jaxpar.ConfigError, match="--hidden 128 does not apply to --model transformer"):
        Config(hidden=128).validate()


# --- resolved() --------------------------------------------------------------------------------------------------
def test_resolved_fills_the_declared_defaults_that_apply():
    config = Config()
    resolved = config.resolved()
    assert config.layers is None  # a copy
    assert {n: getattr(resolved, n) for n in MODEL_DEFAULTS["transformer"]} == MODEL_DEFAULTS["transformer"]
    assert resolved.hidden is None and resolved.channels is None and resolved.bn is None
    mlp = Config(model="mlp").resolved()
    assert mlp.hidden == 128 and mlp.layers is None and mlp.heads is None
    cnn = Config(model="cnn").resolved()
    assert cnn.channels == (16, 32) and cnn.bn == "sync" and cnn.hidden is None
    assert Config(model="transformer", layers=1).resolved().layers == 1  # given values stay
    assert resolved.resolved() == resolved and resolved.validate() is resolved


@pytest.mark.parametrize("name", list(strategies.REGISTRY))
def test_resolved_strategy_options_are_the_strategies_own_defaults(name):
    resolved = Config(strategy=name).resolved()
    for option, strategies_ in APPLIES_TO.items():
        expected = cli_strategies.option_default(name, option) if name in strategies_ else None
        assert getattr(resolved, option) == expected, option
    resolved.validate()


@pytest.mark.parametrize("changes, bn", [
    ({}, "sync"), ({"allreduce": "ring"}, "local"), ({"strategy": "local_sgd"}, "local"),
    ({"strategy": "ssp"}, "local"), ({"strategy": "asp"}, "local"), ({"strategy": "diloco"}, "local"),
])
def test_batchnorm_default_and_the_bn_sync_check_ask_the_strategy(changes, bn):
    config = Config(model="cnn", **changes)
    assert config.resolved().bn == bn == ("local" if cli_strategies.from_config(config).local_statistics else "sync")
    if bn == "local":
        with pytest.raises(jaxpar.ConfigError, match="--bn sync needs --strategy sync without --allreduce"):
            config.replace(bn="sync").validate()
    else:
        config.replace(bn="sync").validate()
    config.replace(bn="local").validate()


def test_bn_sync_check_is_not_decided_again_by_config(monkeypatch):
    Config(model="cnn", strategy="local_sgd", bn="local").validate()
    monkeypatch.setattr(strategies.LocalSGD, "local_statistics", False)  # a strategy that shares the statistics
    Config(model="cnn", strategy="local_sgd", bn="sync").validate()
    assert Config(model="cnn", strategy="local_sgd").resolved().bn == "sync"


def test_models_read_resolved_configs(monkeypatch):
    for name in ("Transformer", "MLP", "CNN"):
        monkeypatch.setattr(models.registry, name, lambda **kwargs: kwargs)  # what the model would be built with
    assert models.factory(Config(layers=1, d_model=32))(None)["layers"] == 1
    assert {k: v for k, v in models.factory(Config(layers=1, d_model=32))(None).items()
            if k in ("seq_len", "vocab", "heads", "d_ff")} == {"seq_len": 128, "vocab": 256, "heads": 4, "d_ff": 512}
    assert models.factory(Config(model="mlp"))(None)["hidden"] == 128
    assert models.factory(Config(model="cnn"))(None)["channels"] == (16, 32)
    assert models.loss_for(Config(model="cnn", label_smoothing=0.1)).keywords == {"label_smoothing": 0.1}


# --- validation keeps its checks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, message", [
    ({"heads": 3}, "--d-model 128 does not divide by --heads 3"),
    ({"d_model": 64, "heads": 5}, "--d-model 64 does not divide by --heads 5"),
    ({"vocab": 100}, "--vocab 100: byte-level text needs a vocabulary of at least 256"),
    ({"vocab": 1}, "--vocab 1: must be an integer >= 2"),
    ({"seq_len": 1}, "--seq-len 1: must be an integer >= 2"),
    ({"model": "mlp", "hidden": 0}, "--hidden 0: must be an integer >= 1"),
    ({"model": "cnn", "channels": (8, 0)}, "channels (8, 0): must be two positive integers"),
    ({"layers": "2"}, "--layers '2': must be an integer"),
    ({"seed": -1}, "--seed -1: must be in [0, 2**32)"),
    ({"strategy": "diloco", "outer_lr": 0.0}, "--outer-lr 0.0: must be > 0"),
    ({"strategy": "local_sgd", "local_after": -1}, "--local-after -1: must be an integer >= 0"),
    ({"torus": 0}, "--torus 0: must be an integer >= 1"),
    ({"mesh": "2x2x2x2"}, "--mesh '2x2x2x2': 4 axes given"),
    ({"eval_batches": -1}, "--eval-batches -1: must be an integer >= 0"),
    ({"read_ahead": -1}, "--read-ahead -1: must be an integer >= 0"),
    ({"rules": {"mlp": 3}}, "rules {'mlp': 3}: must map logical axis names"),
    ({"rules": [("mlp",)]}, "rules [('mlp',)]: must map logical axis names"),
    ({"rules": [("mlp", 3)]}, "rules [('mlp', 3)]: must map"),
    ({"rules": "mlp=model"}, "rules 'mlp=model': must map"),
    ({"pipeline": "pipedream"}, "--pipeline 'pipedream' is not a pipeline schedule"),
    ({"microbatches": 0}, "--microbatches 0: must be an integer >= 1"),
    ({"repeats": 2}, "--repeats 2 applies only to --pipeline circular (got gpipe)"),
    ({"mesh": "stage=2", "layers": 3}, "--layers 3 does not divide by the stage axis of size 2"),
])
def test_checks_are_one_line_config_errors(changes, message):
    with pytest.raises(jaxpar.JaxparError) as raised:  # ConfigError; MeshError for --mesh
        Config(**changes).validate()
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("rules, pairs", [
    (None, None),
    ({"mlp": "model", "embed": None}, (("mlp", ("model",)), ("embed", ()))),
    ({"embed": ("data", "fsdp")}, (("embed", ("data", "fsdp")),)),
    ([("mlp", "model"), ("embed", "fsdp"), ("embed", None)], (("mlp", ("model",)), ("embed", ("fsdp",)), ("embed", ()))),
    ([["heads", ["fsdp", "model"]]], (("heads", ("fsdp", "model")),)),
    ((("vocab", "model"),), (("vocab", ("model",)),)),
])
def test_rules_dict_or_flax_list_of_pairs_is_accepted(rules, pairs):
    """Both forms validate, are kept as given, survive the config record (a checkpoint's) and mean the same ordered
    (logical name, mesh axes) pairs to the partitioner."""
    from jaxpar.parallel.partitioning import normalize_rules

    config = Config(rules=rules).validate()
    assert config.rules == rules
    restored = Config.from_record(config.to_record()).rules
    if pairs is None:
        assert restored is None
    else:
        assert normalize_rules(rules) == normalize_rules(restored) == pairs


def test_parse_gives_a_validated_resolved_config():
    config = run.parse(["--model", "mlp", "--steps", "7"])
    assert (config.model, config.steps, config.hidden, config.heads) == ("mlp", 7, 128, None)
    with pytest.raises(jaxpar.ConfigError, match="--heads 6 does not apply"):
        run.parse(["--model", "mlp", "--heads", "6"])


# --- to_record() ---------------------------------------------------------------------------------------------------
def test_to_record_is_the_resolved_config_with_versions_and_json_serialisable():
    import flax
    import jax
    import optax

    config = Config(model="cnn", strategy="diloco", rules=[("mlp", "model"), ("embed", ("fsdp",))], bn="local")
    record = json.loads(json.dumps(config.to_record()))
    assert record["versions"] == {"jaxpar": record["versions"]["jaxpar"], "jax": jax.__version__,
                                  "flax": flax.__version__, "optax": optax.__version__}
    assert record["versions"]["jaxpar"]
    resolved = config.resolved()
    for f in dataclasses.fields(Config):
        assert f.name in record
    assert record["channels"] == [16, 32] and record["sync_period"] == 4 and record["outer_lr"] == 0.7
    assert record["rules"] == [["mlp", "model"], ["embed", ["fsdp"]]] and record["hidden"] is None
    assert Config.from_record(record) == resolved.replace(rules=[("mlp", "model"), ("embed", ("fsdp",))])
    assert Config.from_record(Config().to_record()) == Config().resolved()
