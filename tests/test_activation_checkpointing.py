"""--activation-checkpointing: fewer activations kept, recomputed in the ranks, the same weights and statistics."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import final_weights, observed_forwards, observed_model, read_summary, run_cli


def saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during one forward of ``model``."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x).sum().backward()
    return total


def test_checkpointed_blocks_keep_fewer_activations_and_recompute_them() -> None:
    from nodescale.config.schema import ModelSection
    from nodescale.models.activation_checkpointing import apply_activation_checkpointing
    from nodescale.models.registry import build_model
    from nodescale.models.spec import InputSpec

    spec = InputSpec(shape=(3, 16, 16), num_classes=10)
    torch.manual_seed(0)
    plain = build_model(ModelSection(name="resnet18"), spec)
    checkpointed = build_model(ModelSection(name="resnet18"), spec)
    checkpointed.load_state_dict(plain.state_dict())
    blocks = apply_activation_checkpointing(checkpointed, "resnet18")
    assert blocks == 8
    calls = []
    checkpointed.layer1[0].conv1.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(4, 3, 16, 16)
    assert saved_activation_bytes(checkpointed, x) < 0.5 * saved_activation_bytes(plain, x)
    assert len(calls) == 2  # the forward, and its recomputation in backward
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(plain.named_buffers(), checkpointed.buffers(), strict=True):
        assert torch.equal(a, b), name  # running statistics updated once, not twice


# The stem's convolution runs once a step; the first block's, inside a checkpointed block, once more in backward.
WATCH = ["conv1", "layer1.0.conv1"]


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_training_with_checkpointing_ends_bit_identical(strategy: str, tmp_path: Path) -> None:
    steps = 3
    args = ["train", "--dataset", "synthetic", "--set", "data.image_size=16", "--set", "data.samples=64",
            "--batch-size", "8", "--max-steps", str(steps), "--optimizer", "sgd", "--strategy", strategy,
            "--nproc", "2", "--no-progress"]
    for run, flags in (("plain", []), ("checkpointed", ["--activation-checkpointing"])):
        # nodescale's resnet18, its forwards recorded on each rank
        model = observed_model("resnet18", (3, 16, 16), tmp_path / f"{run}-forwards", WATCH)
        run_cli([*args, *model, *flags, "--out", run], cwd=tmp_path)
    plain, checkpointed = final_weights(tmp_path / "plain"), final_weights(tmp_path / "checkpointed")
    assert plain.keys() == checkpointed.keys()
    assert all(torch.equal(plain[k], checkpointed[k]) for k in plain)  # BatchNorm buffers included
    assert read_summary(tmp_path / "checkpointed")["val_loss"] == read_summary(tmp_path / "plain")["val_loss"]
    # The flag took effect in the ranks: each step's backward ran the checkpointed block's forward again.
    for run, block_forwards in (("plain", steps), ("checkpointed", 2 * steps)):
        forwards = observed_forwards(tmp_path / f"{run}-forwards")
        assert sorted(forwards) == [0, 1]
        for rank, lines in forwards.items():
            trained = Counter(line["module"] for line in lines if line["training"])
            assert trained == {"conv1": steps, "layer1.0.conv1": block_forwards}, (run, rank, trained)


def test_a_model_without_blocks_is_refused(tmp_path: Path) -> None:
    result = run_cli(["train", "--model", "toy", "--dataset", "regression", "--activation-checkpointing",
                      "--nproc", "1", "--max-steps", "1", "--out", "run"], cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert "no repeated blocks" in result.stderr and "Traceback" not in result.stderr
