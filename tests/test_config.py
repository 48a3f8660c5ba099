"""Configuration: defaults < YAML < flags, and every bad input rejected with value, rule and hint."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nodescale.cli.main import main
from nodescale.config.load import dump_yaml, load_config
from nodescale.errors import UserError


def test_defaults_are_the_embedded_job() -> None:
    cfg = load_config()
    assert (cfg.model.name, cfg.data.name, cfg.strategy.name, cfg.strategy.nproc) == ("cnn", "digits", "ddp", "auto")


def test_precedence_defaults_yaml_flags(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  epochs: 7\n  batch_size: 16\noptim:\n  lr: 0.01\n")
    cfg = load_config(config, {"train.batch_size": "8"})
    assert cfg.train.epochs == 7  # from YAML
    assert cfg.train.batch_size == 8  # flag beats YAML
    assert cfg.optim.lr == 0.01
    assert cfg.train.seed == 0  # default


def test_show_output_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--epochs", "3", "--lr", "0.05", "--set", "optim.weight_decay=0.1"]) == 0
    shown = capsys.readouterr().out
    path = tmp_path / "shown.yaml"
    path.write_text(shown)
    cfg = load_config(path)
    assert cfg.train.epochs == 3 and cfg.optim.lr == 0.05 and cfg.optim.weight_decay == 0.1
    assert dump_yaml(cfg) == shown


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--batch-size", "0"], ["--batch-size 0", "greater than or equal to 1"]),
        (["--epochs", "abc"], ["--epochs abc", "integer"]),
        (["--strategy", "ddpp"], ["'ddpp'", "did you mean 'ddp'"]),
        (["--model", "resnet19"], ["'resnet19'", "did you mean 'resnet18'"]),
        (["--dataset", "digit"], ["'digit'", "did you mean 'digits'"]),
        (["--precision", "bf61"], ["--precision bf61", "did you mean 'bf16'"]),
        (["--set", "train.epoch=3"], ["'train.epoch'", "did you mean 'train.epochs'"]),
        (["--set", "trian.epochs=3"], ["'trian'", "did you mean 'train'"]),
        (["--set", "noequals"], ["KEY=VALUE"]),
        (["--lr", "-1"], ["--lr -1", "greater than 0"]),
        (["--nproc", "0"], ["nproc '0'", "at least 1"]),
        (["--nproc", "many"], ["nproc 'many'", "whole number"]),
        (["--strategy", "single", "--nproc", "2"], ["one process", "--strategy ddp"]),
        (["--strategy", "single", "--sync-batchnorm"], ["sync_batchnorm", "--strategy ddp"]),
        (["--strategy", "ddp", "--sharding", "full"], ["--sharding full", "applies to --strategy fsdp"]),
        (["--strategy", "ddp", "--sharding", "grad-op"], ["grad-op", "applies to --strategy fsdp"]),
        (["--model", "toy"], ["regression", "regression"]),
        (["--dataset", "mnist"], ["needs the location", "--data-dir"]),
        (["--resume"], ["--resume", "--out"]),
        (["--strategy", "deepspeed", "--checkpoint-async"], ["--checkpoint-async with strategy 'deepspeed'",
                                                              "--strategy fsdp"]),
        (["--config", "/nonexistent.yaml"], ["/nonexistent.yaml", "does not exist"]),
    ],
)
def test_bad_input_exits_2_with_value_rule_and_hint(
    argv: list[str], expected: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    assert "hint:" in captured.err
    for text in expected:
        assert text in captured.err


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: [1,\n")
    with pytest.raises(UserError, match="line"):
        load_config(bad)


def test_yaml_unknown_section_and_wrong_type(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: cnn\nmodle: {}\n")
    with pytest.raises(UserError, match="did you mean 'model'"):
        load_config(bad)
    bad.write_text("train: 5\n")
    with pytest.raises(UserError, match="train"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(UserError, match="mapping"):
        load_config(bad)


def test_relative_input_paths_are_stored_absolute(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """config.yaml must name the same files when reused from another directory."""
    monkeypatch.chdir(tmp_path)
    assert main(["config", "show", "--dataset", "mnist", "--data-dir", "data/mnist", "--strategy", "deepspeed",
                 "--set", "strategy.deepspeed_config=ds.json", "--out", "runs/x"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["data"]["dir"] == str(tmp_path / "data" / "mnist")
    assert shown["strategy"]["deepspeed_config"] == str(tmp_path / "ds.json")
    assert shown["out"] == "runs/x"  # printed back to the user as typed
    assert main(["config", "show", "--dataset", "mnist", "--data-dir", "/abs/mnist"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["data"]["dir"] == "/abs/mnist"
