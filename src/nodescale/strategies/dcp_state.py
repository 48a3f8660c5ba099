"""Sharded checkpoints of torch-native strategies through ``torch.distributed.checkpoint`` (DCP).

Every rank writes the shards it owns (FSDP's DTensor shards; a replicated
tensor is written once, by the lowest rank that holds it) into one directory
with a ``.metadata`` index. Loading reads, on every rank, just the pieces its
own shards need, so a checkpoint written by N ranks loads on M ranks, and into
a plain unsharded model: DCP reshards on load.

The state is ``{"model": ..., "optimizer": ...}`` in DCP's layout: parameters
by fully qualified name, optimiser state keyed by those names too.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save_dcp(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Write ``model`` (the plain or fully_shard-ed module) and ``optimizer`` into ``directory``."""
    with _single_process_is_intended():
        dcp.save(_state(model, optimizer), checkpoint_id=directory, planner=_planner())


def async_save_dcp(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, group: Any) -> Future:
    """:func:`save_dcp` through DCP's ``async_save``: returns once the state is copied to host memory; the
    future is done when this rank's files are written and synced. ``group``: a gloo group for DCP's
    collectives, apart from the training's (None without a process group)."""
    with _single_process_is_intended():
        # Only the arguments torch 2.6 has: its default is a thread of this process, as later versions'.
        saved = dcp.async_save(_state(model, optimizer), checkpoint_id=directory, planner=_planner(),
                               process_group=group)
    return getattr(saved, "upload_completion", saved)  # an AsyncSaveResponse where a stager stages in the background


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def _planner() -> DefaultSavePlanner:
    # Lowest rank: BatchNorm statistics (plain tensors every rank holds) are rank 0's,
    # as in a full checkpoint and under DDP, which broadcasts rank 0's buffers.
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def load_dcp(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load what :func:`save_dcp` wrote, on any world size, into ``model`` and ``optimizer``.

    The current state dicts are the template DCP fills in: their placements say
    which pieces this rank needs (``get_state_dict`` creates the optimiser state
    first, with a zero-learning-rate step, so there is a slot for every entry).
    """
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


@contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Without a process group (single, dp) DCP warns on every call that it assumes one process: it is right."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
        yield
