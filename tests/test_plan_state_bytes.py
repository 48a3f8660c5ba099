"""The plan's state bytes are what the strategies really hold: its estimate equals the measured figure.

Each run is real, 2 ranks on gloo, and reports ``state_bytes_per_rank`` in its summary.json
(``strategies.footprint``, DeepSpeed's own ``footprint``). The estimate is ``nodescale plan``'s
arithmetic over the parameter shapes it measures on the meta device, for the run's model,
strategy, optimiser and DeepSpeed config. Most runs are the SGD runs test_fsdp.py and
test_deepspeed.py make anyway (tests/shared_runs.py); this module adds two AdamW runs, whose
optimiser keeps two states and a ``step`` per parameter (DeepSpeed: per flat group), one of them
ZeRO-3 at DeepSpeed's default persistence threshold (the shared ZeRO-3 vit partitions everything).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import read_summary, run_cli

pytestmark = pytest.mark.multiproc
pytest_plugins = ["shared_runs"]

TOLERANCE = 0.02
KINDS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes")
ADAMW = ["train", "--max-steps", "2", "--batch-size", "8", "--no-progress", "--nproc", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, fsdp_equivalence_runs: dict[str, Path],
         zero_equivalence_runs: dict[str, Path]) -> dict[str, Path]:
    """Every run to check: the shared FSDP, ZeRO and DDP runs, and this module's two AdamW runs."""
    root = tmp_path_factory.mktemp("plan-adamw")
    run_cli([*ADAMW, "--strategy", "fsdp", "--out", str(root / "adamw-cnn-full")], cwd=root)
    run_cli([*ADAMW, "--model", "vit_tiny", "--set", "model.patch_size=4", "--strategy", "deepspeed",
             "--zero-stage", "3", "--out", str(root / "adamw-vit-zero3")], cwd=root)
    return {**fsdp_equivalence_runs, **zero_equivalence_runs,
            "adamw-cnn-full": root / "adamw-cnn-full", "adamw-vit-zero3": root / "adamw-vit-zero3"}


def estimate(run_dir: Path) -> dict[str, int]:
    """What the plan says one rank of the run in ``run_dir`` holds, from its config.yaml alone."""
    from nodescale.config.load import load_config
    from nodescale.plan.inputs import dataset_facts
    from nodescale.plan.make import persistence_threshold
    from nodescale.plan.model_facts import measure_model
    from nodescale.plan.options import StrategyOption
    from nodescale.plan.state_bytes import Optimiser, state_bytes

    cfg = load_config(run_dir / "config.yaml")
    spec, _ = dataset_facts(cfg)
    facts = measure_model(cfg, spec)
    strategy = cfg.strategy
    if strategy.name == "deepspeed":
        option = StrategyOption("zero", str(strategy.zero_stage))
    elif strategy.name == "fsdp":
        option = StrategyOption("fsdp", strategy.sharding)
    else:
        option = StrategyOption("ddp")
    world = read_summary(run_dir)["world_size"]
    held = state_bytes(option, facts.shapes, world, world, Optimiser.named(cfg.optim.name, cfg.optim.momentum),
                       cfg.train.precision, persistence_threshold(cfg))
    return held.as_dict()


CHECKED = ["cnn-ddp", "cnn-full", "cnn-grad-op", "cnn-hybrid", "cnn-zero1", "cnn-zero2", "cnn-zero3",
           "vit-ddp", "vit-full", "vit-zero1", "vit-zero2", "vit-zero3", "adamw-cnn-full", "adamw-vit-zero3"]


@pytest.mark.parametrize("name", CHECKED)
def test_estimated_state_bytes_equal_the_measured(runs: dict[str, Path], name: str) -> None:
    measured = read_summary(runs[name])["state_bytes_per_rank"]
    estimated = estimate(runs[name])
    for kind in (*KINDS, "total_bytes"):
        assert abs(estimated[kind] - measured[kind]) <= TOLERANCE * measured[kind], (name, kind, estimated, measured)
