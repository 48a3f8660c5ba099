"""Runs several test modules compare against, made once per session (a plugin: ``pytest_plugins``).

The DDP references here are what FSDP (tests/test_fsdp.py) and DeepSpeed ZeRO
(tests/test_deepspeed.py) must end with: the same commands, so one run serves both.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli

SGD = ["--optimizer", "sgd", "--lr", "0.05", "--set", "optim.schedule=constant", "--no-progress", "--seed", "3"]
CNN = ["train", "--max-steps", "8", "--batch-size", "16", *SGD]
# 4x4 patches of the 8x8 digits: 4 tokens, not the default 64; the 12 blocks and their parameters stay,
# and the arithmetic is a sixteenth (evaluation of 359 samples dominated these runs).
VIT = ["train", "--model", "vit_tiny", "--set", "model.patch_size=4", "--max-steps", "4", "--batch-size", "8", *SGD]


@pytest.fixture(scope="session")
def ddp_references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``cnn-ddp``: CNN's 8 SGD steps of 2 DDP ranks x 16; ``vit-ddp``: VIT's 4 steps of 2 x 8."""
    root = tmp_path_factory.mktemp("ddp-references")
    run_cli([*CNN, "--nproc", "2", "--out", str(root / "cnn-ddp")], cwd=root)
    run_cli([*VIT, "--nproc", "2", "--out", str(root / "vit-ddp")], cwd=root)
    return {"cnn-ddp": root / "cnn-ddp", "vit-ddp": root / "vit-ddp"}
