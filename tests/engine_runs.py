"""Runs of ``nodescale train`` that tests in several files read: each runs once per session.

Registered through ``pytest_plugins`` by the modules that use them (test_training, test_restarts); they
import this module for type checking only, so that pytest imports it first, as a plugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import run_cli


@dataclass(frozen=True)
class TwoRankRun:
    """A finished run directory and the ``nodescale`` arguments (without ``--out``) that made it."""

    path: Path
    args: list[str]
    checkpoint_steps: list[int]


@pytest.fixture(scope="session")
def uninterrupted_two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> TwoRankRun:
    """300 steps of cnn on 2 gloo ranks, a checkpoint every 20 steps, every one kept.

    300 steps of ~6 ms: long enough to kill a rank after the step-20 checkpoint, short enough for a test.
    Step 20 is mid-epoch (23 steps per epoch), so resuming there restores the sampler position too.
    """
    args = ["train", "--nproc", "2", "--epochs", "20", "--max-steps", "300", "--checkpoint-every", "20",
            "--seed", "0", "--set", "data.num_workers=0", "--no-progress"]
    steps = list(range(20, 301, 20))
    root = tmp_path_factory.mktemp("uninterrupted")
    run_cli([*args, "--keep-last", str(len(steps)), "--out", "run"], cwd=root)
    return TwoRankRun(root / "run", args, steps)
