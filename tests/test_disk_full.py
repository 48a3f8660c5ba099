"""A run whose checkpoints fill the disk: a plain error naming the whole step, nothing lost, a warning first.

The file system is a real tmpfs of a few hundred KB (mounting needs root, which the test
machines have), so the failure is the kernel's ENOSPC, met by torch's writers.
"""

from __future__ import annotations

import os
import re
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import read_summary, run_cli
from nodescale.engine import checkpoint_files, disk_space

CHECKPOINT_KB = 210  # one checkpoint of the default cnn: 2 fit in 500 KB, not 3 (the new one is written before pruning)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 500 KB tmpfs, mounted for this test only."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=500k", "tmpfs", str(mount)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        message = f"cannot mount a tmpfs here ({result.stderr.strip()}): the full-disk tests need root"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _whole(run_dir: Path) -> list[int]:
    """The steps of the checkpoints that pass their manifest check, and nothing half-written beside them."""
    directory = checkpoint_files.checkpoint_dir(run_dir)
    leftovers = [p.name for p in directory.iterdir() if ".partial" in p.name or ".tmp" in p.name]
    assert not leftovers, leftovers
    found = checkpoint_files.list_checkpoints(run_dir)
    assert all(checkpoint_files.verify(path) is None for _, path in found)
    return [step for step, _ in found]


# ddp: rank 0 writes one file; fsdp: every rank writes its shards; fsdp-async: in the background (DCP's async_save)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp-async"])
def test_a_full_disk_ends_the_run_with_the_step_that_is_whole(strategy: str, small_disk: Path) -> None:
    run_dir = small_disk / "run"
    args = ["train", "--strategy", strategy.split("-")[0], "--nproc", "2", "--checkpoint-every", "10", "--max-steps",
            "60", "--no-progress", "--out", str(run_dir), *(["--checkpoint-async"] if "async" in strategy else [])]
    result = run_cli(args, cwd=small_disk.parent, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    whole = _whole(run_dir)
    assert whole, "the first checkpoints fit"
    last_lines = "\n".join(result.stderr.strip().splitlines()[-2:])
    assert "nodescale: error (rank" in last_lines and f"in {run_dir / 'checkpoints'}: " in last_lines, last_lines
    assert f"step {whole[-1]} is whole" in last_lines and "--max-restarts" not in result.stderr, last_lines
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    # what the new save needed and what was left; and the warning before it
    assert re.search(r"\(about 0\.\d\d MB needed, 0\.\d\d MB free\)", last_lines), last_lines
    assert f"checkpoint step {whole[-1] + 10} needs about" in result.stderr, result.stderr[-3000:]
    if strategy == "ddp":  # with room again, --resume goes on from that step and finishes
        subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
        run_cli([*args, "--resume"], cwd=small_disk.parent)
        assert read_summary(run_dir)["global_steps"] == 60
        assert _whole(run_dir)[-1] == 60


def test_a_save_that_may_not_fit_is_warned_of(small_disk: Path) -> None:
    run_dir = small_disk / "run"
    directory = checkpoint_files.checkpoint_dir(run_dir)
    directory.mkdir(parents=True)
    (directory / "step-00000010.pt").write_bytes(b"\0" * CHECKPOINT_KB * 1000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        disk_space.warn_if_short(run_dir, 20)  # 210 KB free: just about fits
    assert not caught
    (small_disk / "filler").write_bytes(b"\0" * 100 * 1000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        disk_space.warn_if_short(run_dir, 20)
    assert len(caught) == 1, caught
    message = str(caught[0].message)
    assert f"checkpoint step 20 needs about 0.21 MB in {directory}, and 0." in message  # 0.19-0.20: tmpfs pages
    assert "MB is free" in message and "step 10 stays whole" in message
