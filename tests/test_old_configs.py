"""Configurations written before the strategy section became one class per strategy still load and resume.

tests/golden/old_configs/ holds config.yaml files of real runs of that code (every strategy key at
its value, defaults included) and one of its fsdp run directories with a checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import read_summary, run_cli
from nodescale.cli.main import main
from nodescale.config.load import dump_yaml, load_config
from nodescale.errors import UserError

OLD = Path(__file__).resolve().parent / "golden" / "old_configs"


@pytest.mark.parametrize(("name", "kept"), [
    ("ddp", {"bucket_cap_mb": 1.0, "static_graph": False, "gradient_as_bucket_view": True}),
    ("fsdp", {"sharding": "grad-op", "cpu_offload": "none", "sync_batchnorm": False}),
    ("deepspeed", {"zero_stage": 2, "deepspeed_config": None, "cpu_offload": "none"}),
])
def test_an_old_config_loads_to_the_same_settings(name: str, kept: dict[str, Any]) -> None:
    old = yaml.safe_load((OLD / f"{name}.yaml").read_text())
    cfg = load_config(OLD / f"{name}.yaml")
    new = cfg.model_dump(mode="json")
    assert cfg.strategy.name == name
    # Every key the old file has keeps its value; keys added since (language models' data.seq_len, ...)
    # hold their defaults.
    defaults = load_config(overrides={"strategy.name": name}).model_dump(mode="json")
    for section, values in new.items():
        if section != "strategy" and isinstance(values, dict):
            assert values == {**defaults[section], **old[section]}, section
        elif section != "strategy":
            assert values == old[section], section
    # Every key the strategy has keeps its value (keys added since, such as fsdp's tp, hold their defaults);
    # the other strategies' keys held their defaults and are gone.
    assert new["strategy"] == {**defaults["strategy"],
                               **{key: value for key, value in old["strategy"].items() if key in new["strategy"]}}
    assert {key: new["strategy"][key] for key in kept} == kept
    assert set(old["strategy"]) - set(new["strategy"])  # the other strategies' keys were dropped
    assert load_config(overrides=yaml.safe_load(dump_yaml(cfg))) == cfg  # the new layout round-trips


def test_another_strategys_key_with_a_value_in_an_old_config_is_refused(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    old = yaml.safe_load((OLD / "ddp.yaml").read_text())
    old["strategy"]["sharding"] = "grad-op"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert main(["config", "show", "--config", str(tmp_path / "config.yaml")]) == 2
    err = capsys.readouterr().err
    assert "sharding 'grad-op' with strategy 'ddp'" in err and "applies to --strategy fsdp" in err
    assert "hint: use --strategy fsdp, or drop --sharding" in err


@pytest.mark.parametrize(("assignments", "refused"), [
    (["strategy.sharding=full", "strategy.zero_stage=null", "strategy.cpu_offload=none"], None),
    (["strategy.static_graph=false", "strategy.bucket_cap_mb=null"], None),
    (["strategy.zero_stage=2"], "zero_stage 2 with strategy 'fsdp'"),
    (["strategy.static_graph=true"], "strategy.static_graph applies to --strategy ddp"),
])
def test_old_set_keys_of_another_strategy_load_at_their_defaults(assignments: list[str], refused: str | None) -> None:
    overrides = {"strategy.name": "fsdp", **dict(text.split("=") for text in assignments)}
    overrides = {key: yaml.safe_load(value) for key, value in overrides.items()}
    if refused is None:
        assert load_config(overrides=overrides).strategy == load_config(overrides={"strategy.name": "fsdp"}).strategy
    else:
        with pytest.raises(UserError, match=refused):
            load_config(overrides=overrides)


def test_an_old_fsdp_run_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    shutil.copytree(OLD / "fsdp_run", tmp_path / "run")
    result = run_cli(["train", "--config", "run/config.yaml", "--out", "run", "--resume"], cwd=tmp_path)
    assert "resumed from" in result.stdout
    summary = read_summary(tmp_path / "run")
    assert summary["global_steps"] == 4 and summary["strategy"] == "fsdp" and summary["world_size"] == 2
    rewritten = load_config(tmp_path / "run" / "config.yaml")  # in the new layout, the same settings
    assert rewritten.strategy == load_config(OLD / "fsdp.yaml").strategy
    assert "zero_stage" not in (tmp_path / "run" / "config.yaml").read_text()
