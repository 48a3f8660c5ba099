"""FSDP2 (``--strategy fsdp``): the same weights as DDP in every sharding mode, resume on other world sizes.

Every test starts real processes through the real CLI. Several FSDP ranks are
started by torchrun (and one through nodescale's own --nproc launcher).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from conftest import cli_env, final_weights, max_difference, observed_forwards, observed_model, read_summary, run_cli

pytestmark = pytest.mark.multiproc
pytest_plugins = ["shared_runs"]  # the DDP runs FSDP must match, and FSDP's, shared with other modules

MODES = ("full", "grad-op", "hybrid", "none")
# FSDP2 reduce-scatters the same gradient sums DDP all-reduces. With SGD the weights have come out
# bit for bit equal on Intel and AMD; the tolerance leaves room for another reduction order.
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
def equivalence_runs(fsdp_equivalence_runs: dict[str, Path]) -> dict[str, Path]:
    """The DDP references, and FSDP on their commands (made once per session: tests/shared_runs.py)."""
    return fsdp_equivalence_runs


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


def test_sharding_divides_the_training_state_per_rank(equivalence_runs: dict[str, Path]) -> None:
    """Parameters + gradients + optimiser state: about half of DDP's with full sharding on 2 ranks."""
    def state_bytes(name: str) -> dict[str, int]:
        return read_summary(equivalence_runs[name])["state_bytes_per_rank"]

    for model in ("cnn", "vit"):
        ddp, full = state_bytes(f"{model}-ddp"), state_bytes(f"{model}-full")
        for kind in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"):
            # Each shard is padded to an even split: a little over half, never near the whole.
            assert 0.45 * ddp[kind] < full[kind] < 0.55 * ddp[kind], (model, kind, ddp, full)
    replicated = state_bytes("cnn-none")
    assert replicated["total_bytes"] == state_bytes("cnn-ddp")["total_bytes"]  # none: every rank holds it all


ARGS = ["train", "--strategy", "fsdp", "--max-steps", "8", "--batch-size", "16", "--grad-accum", "2",
        "--set", "optim.grad_clip=1.0", "--checkpoint-every", "4", "--keep-last", "5", "--no-progress"]


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """FSDP on 2 ranks, AdamW, accumulation and clipping, checkpoints at steps 4 and 8: sharded and full."""
    root = tmp_path_factory.mktemp("fsdp-resume")
    torchrun(2, [*ARGS, "--out", str(root / "sharded")], cwd=root)
    torchrun(2, [*ARGS, "--checkpoint-format", "full", "--out", str(root / "full")], cwd=root)
    return {"sharded": root / "sharded", "full": root / "full"}


def test_every_rank_writes_its_shard_of_the_checkpoint(saved_runs: dict[str, Path]) -> None:
    from nodescale.engine.checkpoint_files import list_checkpoints

    (step, path), _ = list_checkpoints(saved_runs["sharded"])
    assert step == 4 and path.is_dir()
    assert sorted(f.name for f in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json",
                                                      "trainer.pt"]
    sizes = [(path / f"__{rank}_0.distcp").stat().st_size for rank in (0, 1)]
    assert min(sizes) > 0.3 * max(sizes), sizes  # each holds its share, not one rank everything
    trainer_state = torch.load(path / "trainer.pt", weights_only=True)
    assert "model" not in trainer_state and "optimizer" not in trainer_state
    assert trainer_state["layout"] == "torch-dcp" and trainer_state["position"]["global_step"] == 4
    assert not list(path.parent.glob("*.partial"))


def test_the_full_checkpoint_is_a_plain_state_dict(saved_runs: dict[str, Path]) -> None:
    from nodescale.engine.checkpoint_files import list_checkpoints

    (_, path), _ = list_checkpoints(saved_runs["full"])
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["position"]["global_step"] == 4 and state["world_size"] == 2
    model_state = state["model"]
    assert all(type(t) is torch.Tensor for t in model_state.values()), "no DTensors in a full state dict"
    assert not any("_fsdp" in k or "_orig_mod" in k or k.startswith("module.") for k in model_state)
    model = plain_model(state["config"])
    model.load_state_dict(model_state)  # strict: every key, no extra
    optim = state["optimizer"]
    assert sorted(optim["state"]) == list(range(len(list(model.parameters()))))
    assert "exp_avg" in optim["state"][0]


def plain_model(config: dict[str, Any]) -> torch.nn.Module:
    """The run's model, built from its saved configuration, with no process group."""
    from nodescale.config.schema import RunConfig
    from nodescale.data.registry import get_format
    from nodescale.models.registry import build_model

    cfg = RunConfig.model_validate(config)
    return build_model(cfg.model, get_format(cfg.data.name).load(cfg.data, cfg.train.seed).spec)


def test_sharded_and_full_checkpoints_hold_the_same_weights(saved_runs: dict[str, Path]) -> None:
    sharded, full = final_weights(saved_runs["sharded"]), final_weights(saved_runs["full"])
    assert max_difference(sharded, full) == 0.0


def test_an_exported_model_predicts_what_the_run_evaluated(saved_runs: dict[str, Path], tmp_path: Path) -> None:
    run_dir = saved_runs["sharded"]
    result = run_cli(["checkpoint", "export", str(run_dir), "--out", "model.pt"], cwd=tmp_path)
    assert "step-00000008" in result.stdout
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    model = plain_model(config).eval()
    model.load_state_dict(state)
    from nodescale.config.schema import RunConfig
    from nodescale.data.registry import get_format

    cfg = RunConfig.model_validate(config)
    val = get_format(cfg.data.name).load(cfg.data, cfg.train.seed).val
    x, y = next(iter(torch.utils.data.DataLoader(val, batch_size=len(val))))
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).double().mean().item()
    assert accuracy == pytest.approx(read_summary(run_dir)["val_accuracy"], abs=1.5 / len(val))


def test_checkpoint_info_describes_a_sharded_checkpoint(saved_runs: dict[str, Path], tmp_path: Path) -> None:
    result = run_cli(["checkpoint", "info", str(saved_runs["sharded"]), "--json"], cwd=tmp_path)
    info = json.loads(result.stdout)
    assert info["layout"] == "torch-dcp" and info["step"] == 8 and info["world_size"] == 2
    assert info["strategy"] == "fsdp" and info["model_values"] == sum(
        t.numel() for t in final_weights(saved_runs["sharded"]).values())


def resume_from_step_4(run_dir: Path, tmp_path: Path) -> Path:
    """A new run directory holding only ``run_dir``'s step-4 checkpoint (and its settings)."""
    target = tmp_path / "run"
    (target / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-00000004", target / "checkpoints" / "step-00000004")
    return target


@pytest.mark.parametrize("ranks", [1, 3])
def test_fsdp_resumes_on_another_world_size(saved_runs: dict[str, Path], ranks: int, tmp_path: Path) -> None:
    # The reference is the same resume from the same step saved as one full file: both start from the
    # same state only if DCP re-sharded it right for this world size, then run the same arithmetic.
    # 1 x 32 keeps the saved run's global batch (the epoch goes on mid-way); 3 x 16 does not (next epoch).
    finals = {}
    for layout in ("sharded", "full"):
        where = tmp_path / layout
        if layout == "full":
            (where / "run" / "checkpoints").mkdir(parents=True)
            for name in ("step-00000004.pt", "step-00000004.manifest.json"):
                shutil.copy(saved_runs["full"] / "checkpoints" / name, where / "run" / "checkpoints" / name)
        else:
            resume_from_step_4(saved_runs["sharded"], where)
        resume = [*ARGS, "--out", "run", "--resume"]
        if ranks == 1:
            result = run_cli([*resume, "--nproc", "1", "--batch-size", "32"], cwd=where)
        else:
            result = torchrun(ranks, resume, cwd=where)
        assert "resumed from" in result.stdout and "(step 4)" in result.stdout
        summary = read_summary(where / "run")
        assert summary["world_size"] == ranks and summary["global_steps"] == 8
        finals[layout] = final_weights(where / "run")
    assert max_difference(finals["sharded"], finals["full"]) == 0.0


def test_fsdp_resumed_on_the_same_ranks_ends_as_if_never_stopped(saved_runs: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    run_dir = saved_runs["sharded"]
    resume_from_step_4(run_dir, tmp_path)
    torchrun(2, [*ARGS, "--out", "run", "--resume"], cwd=tmp_path)
    assert max_difference(final_weights(tmp_path / "run"), final_weights(run_dir)) == 0.0


def test_ddp_resumes_from_an_fsdp_sharded_checkpoint(saved_runs: dict[str, Path], tmp_path: Path) -> None:
    # The reference is DDP resumed from the same FSDP step saved as one full file: both start from the
    # same state only if the sharded restore is right, then run the same DDP arithmetic, so they agree
    # bit for bit on any CPU. (Against the FSDP run itself they differ by reduction order: FSDP
    # reduce-scatters, DDP all-reduces, and AdamW amplifies the last bits; 1.1e-4 seen on AMD EPYC.)
    args = [*ARGS, "--out", "run", "--resume", "--strategy", "ddp", "--checkpoint-format", "full", "--nproc", "2"]
    finals = {}
    for layout in ("sharded", "full"):
        source = saved_runs[layout]
        if layout == "full":
            (tmp_path / layout / "run" / "checkpoints").mkdir(parents=True)
            for name in ("step-00000004.pt", "step-00000004.manifest.json"):
                shutil.copy(source / "checkpoints" / name, tmp_path / layout / "run" / "checkpoints" / name)
        else:
            resume_from_step_4(source, tmp_path / layout)
        result = run_cli(args, cwd=tmp_path / layout)
        assert "(step 4)" in result.stdout
        finals[layout] = final_weights(tmp_path / layout / "run")
    # (DDP's restore of a full file is checked bit for bit by test_training.py's resume test.)
    assert max_difference(finals["sharded"], finals["full"]) == 0.0


@pytest.mark.parametrize(("args", "message"), [
    (["--strategy", "fsdp", "--sharding", "fulll"], "did you mean 'full'"),
    (["--strategy", "ddp", "--sharding", "grad-op"], "--sharding applies to --strategy fsdp"),
    (["--strategy", "fsdp", "--precision", "fp16"], "--precision bf16"),
    (["--strategy", "fsdp", "--cpu-offload", "optimizer"], "use --cpu-offload all"),
    (["--strategy", "ddp", "--cpu-offload", "all"], "--cpu-offload applies to --strategy fsdp or deepspeed"),
    (["--strategy", "fsdp", "--zero-stage", "3"], "--zero-stage applies to --strategy deepspeed"),
    (["--strategy", "fsdp", "--checkpoint-format", "shards"], "full"),
])
def test_bad_fsdp_settings_are_refused_before_any_process_starts(args: list[str], message: str,
                                                                 tmp_path: Path) -> None:
    result = run_cli(["train", *args, "--out", "run"], cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@dataclass(frozen=True)
class Bf16Case:
    """A model trained in bf16 (through tests/user_code/observed.py), and what one of its layers must see."""

    model: str
    shape: tuple[int, ...]  # of its samples
    data: list[str]
    watch: str  # a Linear or Conv2d of the model
    weight: str  # that layer's weight dtype in the forward; its output is bf16 either way
    settings: dict[str, Any]

    def flags(self, record: Path) -> list[str]:
        return [*observed_model(self.model, self.shape, record, [self.watch], **self.settings), *self.data]


# bf16 matrix products are slow on CPUs without bf16 instructions: the vit sees 4 tokens a sample
# (not 64) and evaluates 8 samples (not 359); bf16 parameters in FSDP's policy are what it is here for.
# BatchNorm keeps fp32 parameters (FSDP's policy, DeepSpeed's config), its forward under bf16 autocast.
BF16_MODELS = [pytest.param(Bf16Case("cnn", (1, 8, 8), [], "layer1.conv", "float32", {}), id="cnn"),
               pytest.param(Bf16Case("vit_tiny", (3, 8, 8), ["--dataset", "synthetic", "--set", "data.image_size=8",
                                                             "--set", "data.samples=64"],
                                     "blocks.0.mlp.0", "bfloat16", {"patch_size": 4}), id="vit_tiny")]


def check_bf16_forwards(record: Path, case: Bf16Case, steps: int) -> None:
    """Each rank trained ``steps`` forwards, and from the first on every forward (evaluation's too) computed
    in bf16. (Before it, nodescale tries a sample on the model as built: in fp32, without gradients.)"""
    forwards = observed_forwards(record)
    assert sorted(forwards) == [0, 1]
    for rank, lines in forwards.items():
        assert sum(line["training"] for line in lines) == steps, (rank, lines)
        run = lines[next(i for i, line in enumerate(lines) if line["training"]):]
        assert not run[-1]["training"], (rank, lines)  # evaluated after training
        assert {(line["weight"], line["output"]) for line in run} == {(case.weight, "bfloat16")}, (rank, lines)


@pytest.mark.parametrize("case", BF16_MODELS)  # with BatchNorm, and without
def test_nproc_starts_the_fsdp_ranks_in_bf16(case: Bf16Case, tmp_path: Path) -> None:
    run_cli(["train", "--strategy", "fsdp", "--nproc", "2", "--precision", "bf16", *case.flags(tmp_path / "forwards"),
             "--batch-size", "8", "--max-steps", "3", "--no-progress", "--out", "run"], cwd=tmp_path)
    summary = read_summary(tmp_path / "run")
    assert summary["world_size"] == 2 and summary["strategy"] == "fsdp" and summary["precision"] == "bf16"
    check_bf16_forwards(tmp_path / "forwards", case, steps=3)  # the setting took effect in the ranks


def test_fsdp_mixed_precision_policy_follows_the_precision_and_batchnorm() -> None:
    from torch import nn

    from nodescale.config.strategy import FSDPSection
    from nodescale.strategies import make_strategy

    plain, with_bn = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    bf16 = make_strategy(FSDPSection(), "bf16")
    policy = bf16.policy_for(plain)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert bf16.policy_for(with_bn).param_dtype is None  # BatchNorm's fp32 buffers need fp32 parameters
    assert make_strategy(FSDPSection(), "fp32").policy_for(plain).param_dtype is None
