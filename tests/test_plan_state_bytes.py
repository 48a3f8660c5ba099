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
def adamw_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """This module's two runs: the cnn under FSDP and the vit under ZeRO-3, with AdamW."""
    root = tmp_path_factory.mktemp("plan-adamw")
    run_cli([*ADAMW, "--strategy", "fsdp", "--out", str(root / "adamw-cnn-full")], cwd=root)
    run_cli([*ADAMW, "--model", "vit_tiny", "--set", "model.patch_size=4", "--strategy", "deepspeed",
             "--zero-stage", "3", "--out", str(root / "adamw-vit-zero3")], cwd=root)
    return {path.name: path for path in root.iterdir()}


# Each run, and the fixture that makes it: a test sets up only its own (the timeout is per test).
RUNS = {
    **dict.fromkeys(["cnn-ddp", "vit-ddp"], "ddp_references"),
    **dict.fromkeys(["cnn-full", "cnn-grad-op", "cnn-hybrid", "vit-full"], "fsdp_equivalence_runs"),
    **dict.fromkeys([f"{model}-zero{stage}" for model in ("cnn", "vit") for stage in (1, 2, 3)],
                    "zero_equivalence_runs"),
    **dict.fromkeys(["adamw-cnn-full", "adamw-vit-zero3"], "adamw_runs"),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_estimated_state_bytes_equal_the_measured(request: pytest.FixtureRequest, name: str) -> None:
    run_dir = request.getfixturevalue(RUNS[name])[name]
    measured = read_summary(run_dir)["state_bytes_per_rank"]
    from nodescale.config.load import load_config
    from nodescale.plan.make import planned_state

    estimated = planned_state(load_config(run_dir / "config.yaml"), read_summary(run_dir)["world_size"]).as_dict()
    for kind in (*KINDS, "total_bytes"):
        assert abs(estimated[kind] - measured[kind]) <= TOLERANCE * measured[kind], (name, kind, estimated, measured)
