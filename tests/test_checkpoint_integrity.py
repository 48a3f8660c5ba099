"""Checkpoint manifests: a save killed midway leaves the previous checkpoint valid; damage is found and skipped.

The unit tests write checkpoints with ``nodescale.engine.checkpoint_files`` directly
(sharded ones without a process group) and kill a real save process midway.
The FSDP test damages a real sharded checkpoint of 2 gloo ranks and resumes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import final_weights, max_difference, run_cli
from nodescale.engine import checkpoint_files as checkpoint
from nodescale.engine import manifest
from nodescale.errors import UserError

STEP_10, STEP_20 = "step-00000010", "step-00000020"


def _state(step: int) -> dict[str, object]:
    return {"model": {"w": torch.full((1000,), float(step))}, "position": {"global_step": step}}


def _write_sharded(run_dir: Path, step: int) -> Path:
    """A sharded checkpoint as one process writes it: two shard files and a subdirectory, then trainer.pt."""
    def shards(directory: Path) -> None:
        (directory / "__0_0.distcp").write_bytes(bytes([step % 256]) * 5000)
        (directory / "deepspeed").mkdir()
        (directory / "deepspeed" / "states.pt").write_bytes(b"x" * 300)

    return checkpoint.write_sharded(run_dir, step, True, lambda: None, shards,
                                    lambda: {"position": {"global_step": step}}, keep_last=3)


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_every_checkpoint_has_a_manifest_of_sizes_and_checksums(tmp_path: Path) -> None:
    full = checkpoint.save(tmp_path, 10, _state(10), keep_last=3)
    sharded = _write_sharded(tmp_path, 20)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [f"{STEP_10}.manifest.json", f"{STEP_10}.pt", STEP_20]  # a directory's manifest is inside
    files = json.loads((tmp_path / "checkpoints" / f"{STEP_10}.manifest.json").read_text())["files"]
    assert files == {full.name: {"bytes": full.stat().st_size, "sha256": manifest.file_digest(full)[1]}}
    listed = json.loads((sharded / "manifest.json").read_text())["files"]
    assert sorted(listed) == ["__0_0.distcp", "deepspeed/states.pt", "trainer.pt"]
    assert listed["__0_0.distcp"]["bytes"] == 5000
    assert checkpoint.verify(full) is None and checkpoint.verify(sharded) is None


def test_flipped_bytes_in_a_full_checkpoint_are_found_and_skipped(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, 10, _state(10), keep_last=3)
    newest = checkpoint.save(tmp_path, 20, _state(20), keep_last=3)
    # Inside the tensor data: torch.load would read it without complaint.
    _flip_byte(newest, newest.stat().st_size // 2)
    assert torch.load(newest, weights_only=True)["position"]["global_step"] == 20
    with pytest.warns(UserWarning, match=rf"{STEP_20}.pt is damaged: {STEP_20}.pt is corrupt \(its SHA-256 differs"):
        state, path = checkpoint.load_newest(tmp_path)
    assert path.name == f"{STEP_10}.pt" and state["position"]["global_step"] == 10


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete shard", "delete manifest", "garble manifest"])
def test_a_damaged_sharded_checkpoint_is_found_and_skipped(tmp_path: Path, damage: str) -> None:
    _write_sharded(tmp_path, 10)
    newest = _write_sharded(tmp_path, 20)
    shard = newest / "__0_0.distcp"
    manifest_file = newest / "manifest.json"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:1000])
        expected = rf"{STEP_20}/__0_0.distcp is truncated \(1000 bytes, {STEP_20}/manifest.json says 5000\)"
    elif damage == "flip":
        _flip_byte(newest / "deepspeed" / "states.pt", 7)
        expected = rf"{STEP_20}/deepspeed/states.pt is corrupt"
    elif damage == "delete shard":
        shard.unlink()
        expected = rf"is incomplete: {STEP_20}/__0_0.distcp is missing"
    elif damage == "delete manifest":
        manifest_file.unlink()
        expected = rf"has no manifest \({STEP_20}/manifest.json is missing\)"
    else:
        manifest_file.write_text('{"format": "nodescale-manifest/1", "files": {')
        expected = rf"has a damaged manifest: {STEP_20}/manifest.json is unreadable"
    with pytest.warns(UserWarning, match=rf"checkpoint \S*{STEP_20} (is damaged: )?{expected}.*; trying an older one"):
        state, path = checkpoint.load_newest(tmp_path)
    assert path.name == STEP_10 and state["position"]["global_step"] == 10


def test_a_full_checkpoint_without_its_manifest_loads_unchecked(tmp_path: Path) -> None:
    # Killed between the file's rename and the manifest, or copied alone: the file is whole (atomic).
    checkpoint.save(tmp_path, 10, _state(10), keep_last=3)
    checkpoint.save(tmp_path, 20, _state(20), keep_last=3)
    (tmp_path / "checkpoints" / f"{STEP_20}.manifest.json").unlink()
    with pytest.warns(UserWarning, match=rf"{STEP_20}.pt has no manifest .*: loading it without checking"):
        state, path = checkpoint.load_newest(tmp_path)
    assert path.name == f"{STEP_20}.pt" and state["position"]["global_step"] == 20


def test_nothing_valid_is_a_user_error(tmp_path: Path) -> None:
    full = checkpoint.save(tmp_path, 10, _state(10), keep_last=3)
    _flip_byte(full, 100)
    (_write_sharded(tmp_path, 20) / "trainer.pt").write_bytes(b"")
    with pytest.warns(UserWarning) as warned, pytest.raises(UserError, match="none of them loads"):
        checkpoint.load_newest(tmp_path)
    assert [STEP_20 in str(w.message) for w in warned] == [True, False]


# A child that saves step 10, then starts step 20 and hangs half-way through it, as a job killed mid-save.
KILLED_SAVE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from nodescale.engine import checkpoint_files as checkpoint

    run_dir, layout = Path(sys.argv[1]), sys.argv[2]
    real_save = torch.save

    def write_half_then_hang(obj, handle):
        real_save(obj, handle)
        handle.truncate(handle.tell() // 2)
        handle.flush()
        time.sleep(120)

    def shards(step):
        def write(directory):
            (directory / "__0_0.distcp").write_bytes(b"s" * 4096)
            if step == 20:
                time.sleep(120)
        return write

    state = {"model": {"w": torch.ones(50_000)}, "position": {"global_step": 0}}
    if layout == "full":
        checkpoint.save(run_dir, 10, state, keep_last=3)
        torch.save = write_half_then_hang
        checkpoint.save(run_dir, 20, state, keep_last=3)
    else:
        for step in (10, 20):
            checkpoint.write_sharded(run_dir, step, True, lambda: None, shards(step), lambda: {"position": {}}, 3)
""")


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_valid(tmp_path: Path, layout: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(tmp_path), layout])
    directory = tmp_path / "checkpoints"
    pattern = f".{STEP_20}.pt.tmp-*" if layout == "full" else f"{STEP_20}.partial/__0_0.distcp"
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size > 0 for p in directory.glob(pattern)):
        assert child.poll() is None and time.monotonic() < deadline, "the save never started"
        time.sleep(0.01)
    time.sleep(0.2)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    left = sorted(p.name for p in directory.iterdir())
    assert any(name.startswith((f".{STEP_20}.pt.tmp-", f"{STEP_20}.partial")) for name in left), left
    assert not (directory / f"{STEP_20}.manifest.json").exists() and not (directory / STEP_20).exists()
    state, path = checkpoint.load_newest(tmp_path)  # no warning: the half-written save is not a candidate
    assert path.name.startswith(STEP_10)
    # The next save clears what the killed one left behind.
    checkpoint.save(tmp_path, 30, _state(30), keep_last=3)
    assert sorted(p.name for p in directory.iterdir() if STEP_20 in p.name) == []


@pytest.mark.multiproc
def test_fsdp_resume_skips_a_truncated_shard_and_refuses_when_nothing_is_valid(tmp_path: Path) -> None:
    args = ["train", "--strategy", "fsdp", "--nproc", "2", "--max-steps", "6", "--checkpoint-every", "3",
            "--keep-last", "3", "--optimizer", "sgd", "--seed", "3", "--no-progress", "--out", "run"]
    run_cli(args, cwd=tmp_path)
    checkpoints = tmp_path / "run" / "checkpoints"
    uninterrupted = final_weights(tmp_path / "run")
    shard = checkpoints / "step-00000006" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])

    resumed = run_cli([*args, "--resume"], cwd=tmp_path)
    assert "step-00000006/__1_0.distcp is truncated" in resumed.stderr
    assert resumed.stderr.count("is truncated") == 1  # rank 0 speaks for both
    assert "resumed from" in resumed.stdout and "step-00000003 (step 3)" in resumed.stdout
    # Steps 4 to 6 again, from the valid step-3 checkpoint: the same weights as before the damage.
    assert max_difference(uninterrupted, final_weights(tmp_path / "run")) == 0.0

    (checkpoints / "step-00000006" / "manifest.json").unlink()
    _flip_byte(checkpoints / "step-00000003" / "trainer.pt", 200)
    refused = run_cli([*args, "--resume"], cwd=tmp_path, check=False)
    assert refused.returncode == 2
    assert "step-00000006 has no manifest" in refused.stderr
    assert "step-00000003/trainer.pt is corrupt" in refused.stderr
    assert "none of them loads" in refused.stderr and "Traceback" not in refused.stderr
    shutil.rmtree(tmp_path / "run")


def test_export_refuses_a_damaged_checkpoint_and_takes_the_newest_whole_one(tmp_path: Path) -> None:
    from nodescale.train.export import integrity, resolve

    older = checkpoint.save(tmp_path, 10, _state(10), keep_last=3)
    newest = checkpoint.save(tmp_path, 20, _state(20), keep_last=3)
    _flip_byte(newest, newest.stat().st_size // 2)
    with pytest.raises(UserError, match=rf"(?s){STEP_20}.pt is corrupt .*newest whole checkpoint"):
        resolve(newest)
    with pytest.warns(UserWarning, match=rf"skipping checkpoint .*{STEP_20}.pt: it is damaged"):
        assert resolve(tmp_path) == older
    assert resolve(tmp_path, verified=False) == newest  # `checkpoint info` shows the newest, damaged or not
    assert "corrupt" in integrity(newest) and integrity(older).startswith("whole")
    _flip_byte(older, older.stat().st_size // 2)
    with pytest.warns(UserWarning), pytest.raises(UserError, match="holds no whole checkpoint"):
        resolve(tmp_path)


def test_export_takes_checkpoints_by_the_rule_resume_uses(tmp_path: Path) -> None:
    from nodescale.train.export import resolve

    full = checkpoint.save(tmp_path, 10, _state(10), keep_last=3)
    sharded = _write_sharded(tmp_path, 20)
    (sharded / "manifest.json").unlink()  # nothing says every shard is there: resume skips it
    with pytest.warns(UserWarning, match=f"skipping checkpoint .*{STEP_20}: it has no manifest"):
        assert resolve(tmp_path) == full
    with pytest.raises(UserError, match="has no manifest"):
        resolve(sharded)
    (tmp_path / "checkpoints" / f"{STEP_10}.manifest.json").unlink()  # a full file alone: taken, unchecked
    with pytest.warns(UserWarning, match="its files cannot be checked"):
        assert resolve(full) == full
