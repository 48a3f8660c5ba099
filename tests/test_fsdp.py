"""FSDP2 (``--strategy fsdp``): the same weights as DDP in every sharding mode, resume on other world sizes.

Every test starts real processes through the real CLI. Several FSDP ranks are
started by torchrun (and one through nodescale's own --nproc launcher).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli_env, final_weights, max_difference, read_summary, run_cli

pytestmark = pytest.mark.multiproc

SGD = ["--optimizer", "sgd", "--lr", "0.05", "--set", "optim.schedule=constant", "--no-progress", "--seed", "3"]
MODES = ("full", "grad-op", "hybrid", "none")
# FSDP2 reduce-scatters the same gradient sums DDP all-reduces; on 2 gloo ranks the
# weights have come out bit for bit equal, the tolerance leaves room for another reduction order.
TOLERANCE = 1e-5


def torchrun(nproc: int, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node NPROC -m nodescale ARGS``; fails the test if it fails."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         "-m", "nodescale", *args], cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=240,
    )
    if result.returncode != 0:
        pytest.fail(f"torchrun {' '.join(args)} exited {result.returncode}\n"
                    f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}")
    return result


@pytest.fixture(scope="module")
def equivalence_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """cnn: 8 SGD steps of 2 ranks x 16, by DDP and by FSDP in each mode; vit_tiny: 4 steps of 2 x 8."""
    root = tmp_path_factory.mktemp("fsdp-equivalence")
    cnn = ["train", "--max-steps", "8", "--batch-size", "16", *SGD]
    vit = ["train", "--model", "vit_tiny", "--max-steps", "4", "--batch-size", "8", *SGD]
    run_cli([*cnn, "--nproc", "2", "--out", str(root / "cnn-ddp")], cwd=root)
    run_cli([*vit, "--nproc", "2", "--out", str(root / "vit-ddp")], cwd=root)
    for mode in MODES:
        torchrun(2, [*cnn, "--strategy", "fsdp", "--sharding", mode, "--out", str(root / f"cnn-{mode}")], cwd=root)
    torchrun(2, [*vit, "--strategy", "fsdp", "--out", str(root / "vit-full")], cwd=root)
    return {path.name: path for path in root.iterdir()}


@pytest.mark.parametrize("mode", MODES)
def test_fsdp_cnn_ends_with_the_weights_of_ddp(equivalence_runs: dict[str, Path], mode: str) -> None:
    fsdp = final_weights(equivalence_runs[f"cnn-{mode}"])
    assert max_difference(fsdp, final_weights(equivalence_runs["cnn-ddp"])) < TOLERANCE
    summary = read_summary(equivalence_runs[f"cnn-{mode}"])
    assert summary["strategy"] == "fsdp" and summary["world_size"] == 2 and summary["global_steps"] == 8
    assert summary["val_samples"] == 359  # evaluated through the sharded model, every sample once


def test_fsdp_vit_ends_with_the_weights_of_ddp(equivalence_runs: dict[str, Path]) -> None:
    fsdp = final_weights(equivalence_runs["vit-full"])
    assert max_difference(fsdp, final_weights(equivalence_runs["vit-ddp"])) < TOLERANCE


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """FSDP on 2 ranks, AdamW, accumulation and clipping, checkpoints at steps 4 and 8."""
    root = tmp_path_factory.mktemp("fsdp-resume")
    args = ["train", "--strategy", "fsdp", "--max-steps", "8", "--batch-size", "16", "--grad-accum", "2",
            "--set", "optim.grad_clip=1.0", "--checkpoint-every", "4", "--keep-last", "5", "--no-progress"]
    torchrun(2, [*args, "--out", str(root / "saved")], cwd=root)
    return root / "saved", args


def test_the_fsdp_checkpoint_is_a_plain_full_state_dict(saved_run: tuple[Path, list[str]]) -> None:
    from nodescale.train.checkpoint import list_checkpoints

    run_dir, _ = saved_run
    (_, path), _ = list_checkpoints(run_dir)
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["position"]["global_step"] == 4 and state["world_size"] == 2
    model_state = state["model"]
    assert all(type(t) is torch.Tensor for t in model_state.values()), "no DTensors in a full state dict"
    assert not any("_fsdp" in k or "_orig_mod" in k or k.startswith("module.") for k in model_state)
    # The same keys and shapes as the plain model's, and it loads into one.
    from nodescale.config.schema import RunConfig
    from nodescale.data.registry import get_format
    from nodescale.models.registry import build_model

    cfg = RunConfig.model_validate(state["config"])
    plain = build_model(cfg.model, get_format(cfg.data.name).load(cfg.data, cfg.train.seed).spec)
    plain.load_state_dict(model_state)  # strict: every key, no extra
    optim = state["optimizer"]
    assert sorted(optim["state"]) == list(range(len(list(plain.parameters()))))
    assert "exp_avg" in optim["state"][0]


@pytest.mark.parametrize("ranks", [1, 3])
def test_fsdp_resumes_on_another_world_size(saved_run: tuple[Path, list[str]], ranks: int, tmp_path: Path) -> None:
    run_dir, args = saved_run
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    shutil.copy(run_dir / "checkpoints" / "step-00000004.pt", tmp_path / "run" / "checkpoints")
    resume = [*args, "--out", "run", "--resume"]
    if ranks == 1:
        result = run_cli([*resume, "--nproc", "1", "--batch-size", "32"], cwd=tmp_path)
    else:
        result = torchrun(ranks, resume, cwd=tmp_path)
    assert "resumed from" in result.stdout and "(step 4)" in result.stdout
    summary = read_summary(tmp_path / "run")
    assert summary["world_size"] == ranks and summary["global_steps"] == 8
    # Another layout sees the rest of the epoch in another order: close to, not equal to, the saved run.
    assert max_difference(final_weights(tmp_path / "run"), final_weights(run_dir)) < 0.5


@pytest.mark.parametrize(("args", "message"), [
    (["--strategy", "fsdp", "--sharding", "fulll"], "did you mean 'full'"),
    (["--strategy", "ddp", "--sharding", "grad-op"], "--sharding applies to --strategy fsdp"),
    (["--strategy", "fsdp", "--precision", "fp16"], "--precision bf16"),
])
def test_bad_fsdp_settings_are_refused_before_any_process_starts(args: list[str], message: str,
                                                                 tmp_path: Path) -> None:
    result = run_cli(["train", *args, "--out", "run"], cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model", ["cnn", "vit_tiny"])  # with BatchNorm, and without
def test_nproc_starts_the_fsdp_ranks_in_bf16(model: str, tmp_path: Path) -> None:
    run_cli(["train", "--strategy", "fsdp", "--nproc", "2", "--precision", "bf16", "--model", model,
             "--batch-size", "8", "--max-steps", "3", "--no-progress", "--out", "run"], cwd=tmp_path)
    summary = read_summary(tmp_path / "run")
    assert summary["world_size"] == 2 and summary["strategy"] == "fsdp" and summary["precision"] == "bf16"


def test_fsdp_mixed_precision_policy_follows_the_precision_and_batchnorm() -> None:
    from torch import nn

    from nodescale.config.schema import StrategySection
    from nodescale.strategies import make_strategy

    plain, with_bn = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    bf16 = make_strategy(StrategySection(name="fsdp"), "bf16")
    policy = bf16.policy_for(plain)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert bf16.policy_for(with_bn).param_dtype is None  # BatchNorm's fp32 buffers need fp32 parameters
    assert make_strategy(StrategySection(name="fsdp"), "fp32").policy_for(plain).param_dtype is None
