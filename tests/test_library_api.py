"""The library API: the example script runs as one process and under torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, cli_env

EXAMPLE = REPO / "examples" / "train_own_model.py"


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc", [1, 2])
def test_example_script_trains_on_every_rank_and_saves_once(tmp_path: Path, nproc: int) -> None:
    args = [str(EXAMPLE), "--epochs", "6", "--out", "model.pt"]
    if nproc == 1:
        result = _run([sys.executable, *args], tmp_path)
    else:
        result = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                       str(nproc), *args], tmp_path)
    # Only rank 0 prints: one line per epoch, not one per rank.
    assert result.stdout.count("epoch 6:") == 1
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert saved["world_size"] == nproc
    assert saved["val_samples"] == 397  # every validation sample exactly once, whatever the world size
    assert saved["val_accuracy"] > 0.9
    assert not list(tmp_path.glob(".model.pt.tmp-*"))  # the atomic write left nothing behind


OWN_GROUP = """
import json, sys
import torch, torch.distributed as dist
import nodescale

dist.init_process_group("gloo")  # the script's own group, before nodescale
mine = dist.group.WORLD
with nodescale.init() as ctx:
    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total)
kept = dist.is_initialized() and dist.group.WORLD is mine
try:  # a failing block leaves the script's group up too
    with nodescale.init():
        raise RuntimeError("boom")
except RuntimeError:
    pass
kept_after_error = dist.is_initialized()
if dist.get_rank() == 0:
    print("RESULT " + json.dumps({"sum": total.item(), "kept": kept, "kept_after_error": kept_after_error}))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_a_group_the_script_started_is_used_and_left_to_the_script(tmp_path: Path) -> None:
    script = tmp_path / "own_group.py"
    script.write_text(OWN_GROUP)
    result = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(script)], tmp_path)
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    assert json.loads(line[len("RESULT "):]) == {"sum": 3.0, "kept": True, "kept_after_error": True}
