"""Runs several test modules compare against, made once per session (a plugin: ``pytest_plugins``).

The DDP references here are what FSDP (tests/test_fsdp.py) and DeepSpeed ZeRO
(tests/test_deepspeed.py) must end with: the same commands, so one run serves both.
The FSDP and ZeRO runs on those commands also serve tests/test_plan_state_bytes.py,
whose estimates must equal their measured state bytes.
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


@pytest.fixture(scope="session")
def fsdp_equivalence_runs(tmp_path_factory: pytest.TempPathFactory, ddp_references: dict[str, Path]) -> dict[str, Path]:
    """The DDP references, and FSDP on their commands: the cnn in each sharding mode, the vit fully sharded."""
    from test_fsdp import MODES, torchrun

    root = tmp_path_factory.mktemp("fsdp-equivalence")
    for mode in MODES:
        torchrun(2, [*CNN, "--strategy", "fsdp", "--sharding", mode, "--out", str(root / f"cnn-{mode}")], cwd=root)
    torchrun(2, [*VIT, "--strategy", "fsdp", "--out", str(root / "vit-full")], cwd=root)
    return {**ddp_references, **{path.name: path for path in root.iterdir()}}


@pytest.fixture(scope="session")
def zero_equivalence_runs(tmp_path_factory: pytest.TempPathFactory, ddp_references: dict[str, Path]) -> dict[str, Path]:
    """The DDP references, and each ZeRO stage on their commands (the cnn and the vit)."""
    import json

    from test_deepspeed import LUMI_SEED_CONFIG, PARTITION_ALL, STAGES, mpiexec
    from test_fsdp import torchrun

    root = tmp_path_factory.mktemp("deepspeed-equivalence")
    (root / "partition_all.json").write_text(json.dumps(PARTITION_ALL))
    (root / "lumi.json").write_text(LUMI_SEED_CONFIG)
    for stage in STAGES:
        deepspeed = ["--strategy", "deepspeed", "--zero-stage", str(stage)]
        # Stage 1 reads the LUMI seed config: one run proves both that it parses and that ZeRO-1 matches DDP.
        cnn_config = ["--deepspeed-config", "lumi.json"] if stage == 1 else []
        run_cli([*CNN, *deepspeed, *cnn_config, "--nproc", "2", "--out", str(root / f"cnn-zero{stage}")], cwd=root)
        vit = [*VIT, *deepspeed, "--deepspeed-config", "partition_all.json", "--out", str(root / f"vit-zero{stage}")]
        if stage == 3:  # Open MPI's mpiexec starts these ranks: nodescale reads them from OMPI_*
            mpiexec(vit, cwd=root)
        else:
            torchrun(2, vit, cwd=root)
    return {**ddp_references, **{path.name: path for path in root.iterdir() if path.is_dir()}}
