"""``--checkpoint-async``: checkpoints written in the background, whole or not at all.

Real gloo ranks: ``nodescale train --nproc 2`` resumed from a background checkpoint ends with
the uninterrupted run's weights (so the state was copied before training changed it); a
script whose disk stalls mid-save goes on training, is killed, and leaves the previous
checkpoint the newest whole one; a background write that fails (a real full tmpfs) stops the
run with the plain full-disk error.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, cli_env, final_weights, max_difference, read_metrics, run_cli
from nodescale.engine import checkpoint_files, manifest
from nodescale.engine.async_save import host_copy
from test_disk_full import small_disk  # noqa: F401  (a fixture)

SCRIPT = REPO / "tests" / "api_scripts" / "background_saves.py"
ARGS = ["train", "--nproc", "2", "--max-steps", "8", "--batch-size", "16", "--seed", "3", "--checkpoint-every", "4",
        "--checkpoint-async", "--no-progress"]


def _resumed_copy(run_dir: Path, step: int, target: Path) -> Path:
    (target / "checkpoints").mkdir(parents=True)
    for path in (run_dir / "checkpoints").glob(f"step-{step:08d}*"):
        (shutil.copytree if path.is_dir() else shutil.copy)(path, target / "checkpoints" / path.name)
    return target


def test_a_host_copy_keeps_the_state_of_the_moment_it_was_taken() -> None:
    model = torch.nn.Linear(3, 3)
    optimizer = torch.optim.AdamW(model.parameters())

    def step() -> None:
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()

    step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "values": {"seen": [1]}}
    copied = host_copy(state)
    expected = {"weight": model.weight.detach().clone(), "exp_avg": optimizer.state[model.weight]["exp_avg"].clone()}
    step()  # in place, as training goes on while the copy is written
    state["values"]["seen"].append(2)
    assert torch.equal(copied["model"]["weight"], expected["weight"])
    assert not torch.equal(copied["model"]["weight"], model.weight)
    assert torch.equal(copied["optimizer"]["state"][0]["exp_avg"], expected["exp_avg"])
    assert copied["values"] == {"seen": [1]} and copied["optimizer"]["state"][0]["step"] == 1
    assert copied["model"]._metadata == state["model"]._metadata  # what load_state_dict reads versions from


def test_a_staged_sharded_checkpoint_on_several_nodes_is_refused(tmp_path: Path) -> None:
    from nodescale.engine import checkpoint_stage
    from nodescale.errors import UserError

    checkpoint_stage.check_one_node(1, True, tmp_path)
    checkpoint_stage.check_one_node(4, False, tmp_path)  # a full file: rank 0 writes and copies it
    with pytest.raises(UserError, match="sharded checkpoint on 4 nodes") as raised:
        checkpoint_stage.check_one_node(4, True, tmp_path)
    assert "--checkpoint-format full" in raised.value.hint
    # one staging folder per run directory: two runs named alike on one node's disk never meet
    assert checkpoint_stage.staged_run_dir(tmp_path, Path("/a/run")) != checkpoint_stage.staged_run_dir(
        tmp_path, Path("/b/run"))


pytestmark = pytest.mark.multiproc


# ddp: rank 0 writes a host copy; fsdp: DCP's async_save writes shards; staged: to local disk, then copied
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "ddp-staged"])
def test_a_run_resumed_from_a_background_checkpoint_ends_with_the_uninterrupted_weights(tmp_path: Path,
                                                                                       strategy: str) -> None:
    args = [*ARGS, "--strategy", strategy.removesuffix("-staged")]
    stage = tmp_path / "local-disk"
    run_cli([*args, "--out", "whole", *(["--checkpoint-stage", str(stage)] if "staged" in strategy else [])],
            cwd=tmp_path)
    whole = tmp_path / "whole"
    if "staged" in strategy:  # each staged checkpoint deleted once copied into the run directory
        assert [p.name for p in stage.glob("*/checkpoints/*")] == [], sorted(stage.rglob("*"))
    assert [r["step"] for r in read_metrics(whole) if r["kind"] == "checkpoint"] == [4, 8]
    found = checkpoint_files.list_checkpoints(whole)
    assert [step for step, _ in found] == [4, 8]
    assert all(checkpoint_files.verify(path) is None for _, path in found)
    # Step 4 was written while steps 5-8 ran: resuming from it must retrace them exactly.
    _resumed_copy(whole, 4, tmp_path / "resumed")
    run_cli([*args, "--out", "resumed", "--resume"], cwd=tmp_path)
    assert max_difference(final_weights(whole), final_weights(tmp_path / "resumed")) == 0.0


def test_a_job_killed_during_a_background_save_resumes_from_the_previous_checkpoint(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
               str(tmp_path / "run"), "fsdp", "kill"]
    result = subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode != 0
    # Both ranks trained on while the step-4 shards were stuck in the disk's fsync.
    assert result.stdout.count("step 6 taken while step 4 was being written") == 2, result.stdout + result.stderr
    directory = checkpoint_files.checkpoint_dir(tmp_path / "run")
    partial = checkpoint_files.partial_dir(tmp_path / "run", 4)
    # Each rank was killed once its own shard was written and stuck in its fsync (the script waits for that).
    shards = sorted(p.name for p in partial.glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], sorted(p.name for p in directory.iterdir())
    assert not (partial / manifest.DIRECTORY_MANIFEST).exists()
    assert not checkpoint_files.sharded_checkpoint_path(tmp_path / "run", 4).exists()
    state, path = checkpoint_files.load_newest(tmp_path / "run")
    assert path.name == "step-00000002" and state["position"]["global_step"] == 2
    assert checkpoint_files.verify(path) is None


def test_a_background_write_that_fills_the_disk_is_the_plain_full_disk_error(small_disk: Path) -> None:  # noqa: F811
    import nodescale

    with pytest.raises(nodescale.errors.UserError) as raised:
        ctx = nodescale.init(strategy="single", out=small_disk / "run", checkpoint_async=True, keep_last=1)
        model = torch.nn.Linear(150, 150)  # 90 KB of weights, 270 KB with AdamW's state: the 500 KB disk fits one
        model, optimizer = ctx.prepare(model, torch.optim.AdamW(model.parameters()))
        with ctx:
            for _ in range(3):
                ctx.backward(model(torch.ones(1, 150)).sum())
                ctx.step(optimizer)
                path = ctx.save_checkpoint({"model": model, "optimizer": optimizer})
                assert path.name == f"step-{ctx.global_step:08d}.pt"  # returned before the write
    text = str(raised.value)
    assert text.startswith(f"checkpoint step 2 in {small_disk / 'run' / 'checkpoints'}: no space left on device")
    assert "step 1 is whole" in text
    left = sorted(p.name for p in (small_disk / "run" / "checkpoints").iterdir())
    assert left == ["step-00000001.manifest.json", "step-00000001.pt"]


def test_a_job_killed_while_a_staged_checkpoint_is_copied_resumes_from_the_previous_one(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
               str(tmp_path / "run"), "fsdp", "stage-kill"]
    result = subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode != 0
    assert result.stdout.count("step 6 taken while step 4 was being written") == 2, result.stdout + result.stderr
    # Step 4 is whole on the local disk; its copy stalled before its manifest, so the run directory has none.
    staged = next((tmp_path / "run-stage").glob("run-*/checkpoints/step-00000004"))
    assert checkpoint_files.verify(staged) is None
    partial = checkpoint_files.partial_dir(tmp_path / "run", 4)
    assert partial.is_dir() and not (partial / manifest.DIRECTORY_MANIFEST).exists()
    assert not checkpoint_files.sharded_checkpoint_path(tmp_path / "run", 4).exists()
    state, path = checkpoint_files.load_newest(tmp_path / "run")
    assert path.name == "step-00000002" and state["position"]["global_step"] == 2
    assert checkpoint_files.verify(path) is None
