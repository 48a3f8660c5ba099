"""Checkpoint files: atomic, pruned to the newest K, and a corrupt newest one falls back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nodescale.atomic_files import write_atomic, write_json_atomic
from nodescale.engine import checkpoint_files as checkpoint
from nodescale.errors import UserError


def _state(step: int) -> dict[str, object]:
    return {"model": {"w": torch.full((3,), float(step))}, "position": {"global_step": step}}


def test_keeps_only_the_newest(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        checkpoint.save(tmp_path, step, _state(step), keep_last=2)
    assert [step for step, _ in checkpoint.list_checkpoints(tmp_path)] == [15, 20]
    state, path = checkpoint.load_newest(tmp_path)
    assert path.name == "step-00000020.pt" and state["position"]["global_step"] == 20


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_newest_falls_back_to_the_previous(tmp_path: Path, damage: str) -> None:
    checkpoint.save(tmp_path, 10, _state(10), keep_last=3)
    newest = checkpoint.save(tmp_path, 20, _state(20), keep_last=3)
    data = newest.read_bytes()
    newest.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x00not a checkpoint" * 10,
                        "empty": b""}[damage])
    with pytest.warns(UserWarning, match="step-00000020.pt is (truncated|corrupt).*trying an older one"):
        state, path = checkpoint.load_newest(tmp_path)
    assert state["position"]["global_step"] == 10 and path.name == "step-00000010.pt"


def test_no_loadable_checkpoint_is_a_user_error(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, 10, _state(10), keep_last=1)
    path.write_bytes(b"broken")
    with pytest.warns(UserWarning), pytest.raises(UserError, match="none of them loads"):
        checkpoint.load_newest(tmp_path)


def test_a_run_without_checkpoints_has_nothing_to_resume(tmp_path: Path) -> None:
    assert checkpoint.load_newest(tmp_path) is None


def test_a_failed_write_leaves_the_old_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "summary.json"
    write_json_atomic(target, {"version": 1})

    def crash_midway(handle: object) -> None:
        handle.write(b'{"version": 2, "trunc')  # type: ignore[attr-defined]
        raise RuntimeError("killed during the write")

    with pytest.raises(RuntimeError):
        write_atomic(target, crash_midway)
    assert target.read_text().strip().startswith('{\n  "version": 1')
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left behind


def test_resume_compares_model_arguments_and_accepts_checkpoints_from_before_them() -> None:
    from nodescale.config.schema import RunConfig

    check_compatible = checkpoint.check_compatible
    current = RunConfig().model_dump(mode="json")
    old = RunConfig().model_dump(mode="json")
    del old["model"]["args"], old["data"]["args"]  # written before the keys existed
    check_compatible({"config": old}, current, Path("run/checkpoints/step-00000004.pt"))
    wider = {**current, "model": {**current["model"], "args": {"width": 64}}}
    with pytest.raises(UserError, match="model.args was {}, now {'width': 64}"):
        check_compatible({"config": current}, wider, Path("run/checkpoints/step-00000004.pt"))
