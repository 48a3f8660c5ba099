"""``--max-restarts``: a rank killed mid-epoch, the group restarted from the newest checkpoint, the same weights.

Real processes on real gloo: ``nodescale train --nproc 2`` in a subprocess,
one worker SIGKILLed once the first checkpoint is on disk. DDP on the CPU with
a fixed seed is deterministic, so the restarted run must end bit for bit with
the weights of an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from conftest import cli_env, final_weights, max_difference, read_summary, run_cli
from proc_tree import worker_of_rank

if TYPE_CHECKING:
    from engine_runs import TwoRankRun

pytestmark = pytest.mark.multiproc

# uninterrupted_two_rank_run (shared with test_training): the run these tests interrupt, to its end.
pytest_plugins = ["engine_runs"]


def _first_checkpoint_written(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return False
    for line in metrics.read_text().splitlines():
        try:
            if json.loads(line)["kind"] == "checkpoint":
                return True
        except ValueError:  # the line being written
            pass
    return False


def train_and_kill_rank_1(args: list[str], cwd: Path, run_dir: Path) -> subprocess.CompletedProcess[str]:
    """Start ``nodescale ARGS``, SIGKILL the rank-1 worker after the first checkpoint, wait for the end."""
    process = subprocess.Popen([sys.executable, "-m", "nodescale", *args], cwd=cwd, env=cli_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _first_checkpoint_written(run_dir):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.005)
        rank1 = worker_of_rank(process.pid, 1)
        assert rank1 is not None, "no rank-1 worker among the launcher's children"
        os.kill(rank1, signal.SIGKILL)
        stdout, stderr = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def test_a_killed_rank_is_restarted_and_the_run_ends_with_the_uninterrupted_weights(
        uninterrupted_two_rank_run: TwoRankRun, tmp_path: Path) -> None:
    args = uninterrupted_two_rank_run.args
    result = train_and_kill_rank_1([*args, "--max-restarts", "1", "--out", "run"], tmp_path, tmp_path / "run")
    assert result.returncode == 0, result.stderr
    assert "rank 1 exited with -9 (SIGKILL); restarting all 2 processes" in result.stderr
    assert "note: restart 1 of 1 after rank 1 exited with -9 (SIGKILL): resuming from step-000" in result.stdout
    assert read_summary(tmp_path / "run")["global_steps"] == 300
    assert max_difference(final_weights(uninterrupted_two_rank_run.path), final_weights(tmp_path / "run")) == 0.0


def test_without_restarts_a_killed_rank_fails_fast_and_resume_continues(uninterrupted_two_rank_run: TwoRankRun,
                                                                        tmp_path: Path) -> None:
    args = uninterrupted_two_rank_run.args
    result = train_and_kill_rank_1([*args, "--out", "run"], tmp_path, tmp_path / "run")
    assert result.returncode == 1
    assert "worker processes failed: rank 1 exited with -9 (SIGKILL)" in result.stderr
    assert "restarting" not in result.stderr
    assert "with --max-restarts 0; continue with `nodescale train --out run --resume`" in result.stderr
    assert not (tmp_path / "run" / "summary.json").exists()

    # A user error is never retried: it would fail the same way each time.
    refused = run_cli([*args, "--model", "resnet18", "--max-restarts", "3", "--out", "run", "--resume"],
                      cwd=tmp_path, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "model.name was 'cnn', now 'resnet18'" in refused.stderr and "restarting" not in refused.stderr

    resumed = run_cli([*args, "--out", "run", "--resume"], cwd=tmp_path)
    assert "resumed from" in resumed.stdout
    log = (tmp_path / "run" / "ranks.log").read_text().splitlines()  # every launch, each headed
    assert "nodescale: worker processes failed: rank 1 exited with -9 (SIGKILL)" in log
    assert sum(line.startswith("nodescale: launch at ") for line in log) == 3
    assert max_difference(final_weights(uninterrupted_two_rank_run.path), final_weights(tmp_path / "run")) == 0.0
