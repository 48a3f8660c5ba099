"""Read any nodescale checkpoint without a process group: export and inspect.

``consolidated_model_state`` turns a full file, a torch.distributed.checkpoint
directory (FSDP) or a DeepSpeed ZeRO directory into one plain ``state_dict``
that ``model.load_state_dict`` accepts, for inference or fine-tuning elsewhere.
``describe`` says what a checkpoint holds. Both run no code from the files unless asked to trust
them (:mod:`nodescale.untrusted_files`): a checkpoint to export may come from anyone.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch

from nodescale.engine import checkpoint_files
from nodescale.errors import UserError
from nodescale.untrusted_files import dcp_model_planner, dcp_reader, load_weights


def resolve(path: Path, verified: bool = True) -> Path:
    """The checkpoint ``path`` names: itself, or the newest whole one of a run directory.

    ``verified``: the checkpoint's files are checked against its manifest (sizes, SHA-256)
    first, by the rule resuming uses (:func:`checkpoint.loadable`). A named checkpoint that
    fails is an error; in a run directory a damaged newest checkpoint is skipped with a
    warning for the one before it, as resuming does.
    """
    named = _is_checkpoint(path)
    if named:
        candidates = [path]
    else:
        if not path.is_dir():
            raise UserError(f"checkpoint {path}", "does not exist", "pass a run directory or one of its checkpoints")
        candidates = [found for _, found in reversed(checkpoint_files.list_checkpoints(path))]
        if not candidates:
            raise UserError(f"run directory {path}", "holds no checkpoint",
                            "train with --checkpoint-every K, or keep the default save at the end")
    if not verified:
        return candidates[0]
    problems = []
    for candidate in candidates:
        problem = checkpoint_files.verify(candidate)
        if checkpoint_files.loadable(candidate, problem):
            if problem is not None:
                warnings.warn(f"checkpoint {candidate} {problem.text}: its files cannot be checked", stacklevel=2)
            return candidate
        if named:
            raise UserError(f"checkpoint {path}", problem.text,
                            f"export the run directory ({path.parent.parent}) to take its newest whole "
                            "checkpoint, or name an older one")
        warnings.warn(f"skipping checkpoint {candidate}: it {problem.text}", stacklevel=2)
        problems.append(f"{candidate.name} {problem.text}")
    raise UserError(f"run directory {path}", "holds no whole checkpoint: " + "; ".join(problems),
                    "the run has to be trained again from scratch, or from a copy of its checkpoints")


def integrity(path: Path) -> str:
    """``whole`` or what is wrong with checkpoint ``path``'s files, per its manifest."""
    problem = checkpoint_files.verify(path)
    return "whole (sizes and SHA-256 match the manifest)" if problem is None else problem.text


def _is_checkpoint(path: Path) -> bool:
    return path.is_file() or (path / checkpoint_files.TRAINER_FILE).is_file()


def read_trainer_state(path: Path) -> dict[str, Any]:
    """Everything but model and optimiser of checkpoint ``path`` (a full file: all of it)."""
    target = path / checkpoint_files.TRAINER_FILE if checkpoint_files.is_sharded(path) else path
    state = load_weights(target)  # what nodescale writes loads weights-only: trust or not
    if not isinstance(state, dict) or state.get("format") != checkpoint_files.FORMAT:
        raise UserError(f"checkpoint {target}", f"is not a {checkpoint_files.FORMAT} file",
                        "pass a checkpoint written by nodescale train")
    return state


def consolidated_model_state(path: Path, trust: bool = False) -> dict[str, torch.Tensor]:
    """The whole model state dict of checkpoint ``path``, on the CPU, in fp32 where it was trained in it.

    ``trust``: the libraries' own loaders read sharded files (they may run code held in them).
    """
    state = read_trainer_state(path)
    if "model" in state:
        return dict(state["model"])
    layout = state.get("layout")
    if layout == "torch-dcp":
        return _dcp_model_state(path, trust)
    if layout == "deepspeed":
        from nodescale.strategies.deepspeed_export import consolidated_state  # imports deepspeed: only here

        return consolidated_state(path, trust)
    raise UserError(f"checkpoint {path}", f"has an unknown layout {layout!r}",
                    "export it with the nodescale version that wrote it")


def _dcp_model_state(directory: Path, trust: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # The documented dcp_to_torch_save path, restricted to the model's entries: no process
    # group, and the optimiser state (twice the model for Adam) is never read.
    loaded: dict[str, Any] = {}
    reader = dcp_reader(directory, trust)
    reader.read_metadata()  # a refusal as nodescale's own error: torch's loader would bury it in a fallback's
    try:
        _load_state_dict(loaded, storage_reader=reader, planner=dcp_model_planner(directory, trust), no_dist=True)
    except CheckpointException as exc:  # torch wraps what the planner raised: a refusal is the user's to read
        refusals = [error for error, _ in exc.failures.values() if isinstance(error, UserError)]
        if refusals:
            raise refusals[0] from None
        raise
    return dict(loaded["model"])


def describe(path: Path, trust: bool = False) -> dict[str, Any]:
    """What checkpoint ``path`` holds, as plain data (for ``nodescale checkpoint info``)."""
    state = read_trainer_state(path)
    config = state.get("config", {})
    info: dict[str, Any] = {
        "path": str(path),
        "layout": "full" if "model" in state else state.get("layout"),
        "step": state["position"]["global_step"],
        "epoch": state["position"]["epoch"],
        "batch_in_epoch": state["position"]["batch_in_epoch"],
        "world_size": state["world_size"],
        "batch_size_per_process": state["batch_size"],
        "strategy": config.get("strategy", {}).get("name"),
        "model": config.get("model", {}).get("name"),
        "dataset": config.get("data", {}).get("name"),
        "optimizer": config.get("optim", {}).get("name"),
        "precision": config.get("train", {}).get("precision"),
        "bytes_on_disk": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir()
        else path.stat().st_size,
    }
    if path.is_dir():
        info["files"] = sorted(f.name for f in path.iterdir())
    if "model" in state:
        info["model_values"] = sum(t.numel() for t in state["model"].values())
    elif state.get("layout") == "torch-dcp":
        entries = dcp_reader(path, trust).read_metadata().state_dict_metadata
        info["model_values"] = sum(
            math.prod(meta.size) for key, meta in entries.items() if key.startswith("model.") and hasattr(meta, "size")
        )
    return info
