"""Tensor parallelism (``--tp``) inside groups of ranks, FSDP2 across them: a 2-D mesh ("dp", "tp").

One set of real runs through the CLI on gloo serves every multi-rank assertion: gpt_nano under DDP
on 2 ranks, and under TP 2 x FSDP 2 on 4 ranks with the same global batch (each TP group of 2 draws
the batches of one DDP rank), checkpointed half-way; then that checkpoint resumed as TP 2 x FSDP 1
on 2 ranks (DCP re-shards the 2-D DTensors onto the other mesh). The refusals start no process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import final_weights, max_difference, read_summary, run_cli, weights_as_saved
from nodescale.cli.main import main
from nodescale.errors import UserError

pytestmark = pytest.mark.multiproc

STEPS = 4
# Tiny and short: 32-token windows, 73 validation windows (0.5%), SGD without momentum. The gradients' norms
# are 6.2, 4.1, 2.3, 3.4 here and clipped to 5: the first step's only, so a wrong norm (one norm over parameters
# split over a group and parameters replicated over it) and a wrong gradient scale both show in the weights.
GPT_NANO = ["train", "--model", "gpt_nano", "--dataset", "pydoc", "--seq-len", "32", "--set", "data.val_fraction=0.005",
            "--batch-size", "8", "--max-steps", str(STEPS), "--optimizer", "sgd", "--lr", "0.05",
            "--set", "optim.schedule=constant", "--set", "optim.grad_clip=5.0", "--no-progress", "--seed", "3"]
TP = [*GPT_NANO, "--strategy", "fsdp", "--tp", "2", "--nproc", "4", "--checkpoint-every", "2"]

# TP changes only the order of float32 sums: a row-split matmul adds two half-length partial dot products
# (then all-reduced), and a column-split layer's input gradient is the sum of two partial ones. Each step's
# weights w - lr * g then round alike unless the gradients' last bits differ across a rounding boundary:
# at most one unit in the last place of the largest weights (the norms', near 1: 2**-23) per step and per
# such rounding (the gradient's own difference, lr x a few ulps of |g| < 1, is smaller). Over STEPS steps,
# with two roundings a step as margin for other CPUs' kernels: STEPS x 2 x 2**-23 (about 1e-6). Seen here:
# 1.2e-7 (one ulp of a norm weight) against DDP, 1.5e-8 for the resumed run.
TOLERANCE = STEPS * 2 * 2.0**-23


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tensor-parallel")
    run_cli([*GPT_NANO, "--nproc", "2", "--out", str(root / "ddp")], cwd=root)
    run_cli([*TP, "--out", str(root / "tp")], cwd=root)
    # A new run directory holding only the step-2 checkpoint, resumed by one TP group of 2 ranks that takes
    # the global batch of 16 alone (the same batches, the epoch goes on mid-way).
    shutil.copytree(root / "tp" / "checkpoints" / "step-00000002", root / "resumed" / "checkpoints" / "step-00000002")
    run_cli([*TP, "--nproc", "2", "--batch-size", "16", "--out", str(root / "resumed"), "--resume"], cwd=root)
    return {"ddp": root / "ddp", "tp": root / "tp", "resumed": root / "resumed"}


def test_tp_times_fsdp_ends_with_the_weights_of_ddp(runs: dict[str, Path]) -> None:
    assert max_difference(final_weights(runs["tp"]), final_weights(runs["ddp"])) < TOLERANCE
    tp, ddp = read_summary(runs["tp"]), read_summary(runs["ddp"])
    assert (tp["world_size"], tp["tensor_parallel"], tp["global_steps"]) == (4, 2, STEPS)
    assert tp["global_batch_size"] == ddp["global_batch_size"] == 16  # 8 per replica, 2 replicas
    # Evaluated and counted once per sample, not once per rank of a group.
    assert tp["val_samples"] == ddp["val_samples"] == 73
    assert tp["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-5)


def test_each_block_is_split_over_its_group_and_sharded_across_groups(runs: dict[str, Path]) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = runs["tp"] / "checkpoints" / "step-00000004"
    entries = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    # wo is row-split (input features) by TP and its rows sharded by FSDP: four 64 x 64 quadrants.
    # FSDP alone on 4 ranks would write 32 x 128 row blocks.
    chunks = {(tuple(c.offsets), tuple(c.sizes)) for c in entries["model.layers.0.attention.wo.weight"].chunks}
    assert chunks == {((row, col), (64, 64)) for row in (0, 64) for col in (0, 64)}
    # The embedding is replicated over a group: sharded by FSDP only, written once per shard.
    assert len(entries["model.tok_embeddings.weight"].chunks) == 2


def test_a_checkpoint_resumes_on_another_mesh(runs: dict[str, Path]) -> None:
    # From the restored step-2 state the resumed run sums its gradients in another order (one rank's batch
    # of 16, no reduce-scatter), so it ends within the same rounding bound, not bit for bit. A state restored
    # wrong, or the wrong batches after it, would be off by the size of a step (lr x gradient, about 1e-3).
    assert max_difference(final_weights(runs["resumed"]), final_weights(runs["tp"])) < TOLERANCE
    resumed = read_summary(runs["resumed"])
    assert (resumed["world_size"], resumed["global_steps"], resumed["global_batch_size"]) == (2, STEPS, 16)


def test_export_gives_a_plain_full_state_dict(runs: dict[str, Path], tmp_path: Path) -> None:
    from nodescale.models.gpt import GPT, NANO

    assert main(["checkpoint", "export", str(runs["tp"]), "--out", str(tmp_path / "model.pt")]) == 0
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(type(t) is torch.Tensor for t in state.values()), "no DTensors in an export"
    GPT(NANO, vocab_size=256, seq_len=32).load_state_dict(state)  # strict: every key, whole shapes
    # The values of the 2-D shards, put together by DCP's own loader (not nodescale's, as export's are).
    saved = weights_as_saved(runs["tp"] / "checkpoints" / "step-00000004")
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in state)


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "cnn", "--strategy", "fsdp", "--tp", "2"], "declares no tensor-parallel plan"),
    (["--model", "gpt_nano", "--dataset", "pydoc", "--strategy", "fsdp", "--tp", "2", "--nproc", "3"],
     "must be a multiple of --tp (2)"),
    (["--strategy", "fsdp", "--sharding", "hybrid", "--tp", "2"], "already makes a 2-D mesh"),
    (["--strategy", "fsdp", "--sharding", "none", "--tp", "2"], "already makes a 2-D mesh"),
    (["--strategy", "ddp", "--tp", "2"], "--tp applies to --strategy fsdp"),
    (["--strategy", "deepspeed", "--tp", "2"], "--tp applies to --strategy fsdp"),
    (["--strategy", "single", "--tp", "2"], "--tp applies to --strategy fsdp"),
    (["--set", "strategy.tp=2"], "tp 2 with strategy 'ddp'"),  # ddp, the default
    (["--strategy", "fsdp", "--tp", "0"], "--tp"),
])
def test_tp_where_it_cannot_apply_is_refused_before_any_process_starts(
        args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and "hint:" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_heads_that_do_not_divide_over_the_group_are_refused() -> None:
    from nodescale.models.gpt import GPT, NANO, GPTShape
    from nodescale.strategies.tensor_parallel import checked_plan

    nano = GPT(NANO, vocab_size=256, seq_len=32)  # 4 heads over 2 key/value heads
    blocks, plan = checked_plan(nano, 2)
    assert len(blocks) == 4 and plan["attention.wo"] == "rowwise"
    with pytest.raises(UserError, match=r"key/value heads \(2\) do not divide evenly over 4 ranks") as refused:
        checked_plan(nano, 4)
    assert refused.value.hint == "use --tp 2"
    three_heads = GPT(GPTShape(layers=1, dim=96, heads=3), vocab_size=256, seq_len=32)  # 96 divides by 2; 3 not
    with pytest.raises(UserError, match=r"attention heads \(3\)"):
        checked_plan(three_heads, 2)


def test_a_model_without_a_plan_is_refused() -> None:
    from nodescale.strategies.tensor_parallel import checked_plan

    blocks = nn.Sequential(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))  # a user's model: blocks, no plan
    with pytest.raises(UserError, match="declares no tensor-parallel plan"):
        checked_plan(blocks, 2)
