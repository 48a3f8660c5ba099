"""Bytes of parameters, gradients and optimiser state one rank holds (torch-native strategies).

Sharded tensors (FSDP2's DTensors) count their local shard only. A storage
reached twice (DDP's gradients are views into its buckets; tied weights) counts
once, under the first kind that reached it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from nodescale.strategies.base import Footprint


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # DTensor: this rank's shard
    return to_local() if callable(to_local) else tensor


class StorageCounter:
    """Sums the bytes of distinct storages, so shared memory is counted once."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, int]] = set()

    def add(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """The bytes of the storages among ``tensors`` not counted before."""
        total = 0
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = _local(tensor).untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key in self._seen or storage.nbytes() == 0:
                continue
            self._seen.add(key)
            total += storage.nbytes()
        return total


def tensor_footprint(model: nn.Module, optimizer: torch.optim.Optimizer) -> Footprint:
    """What ``model``'s parameters and gradients and ``optimizer``'s state occupy on this rank."""
    counter = StorageCounter()
    parameters = list(model.parameters())
    parameter_bytes = counter.add(parameters)
    gradient_bytes = counter.add(p.grad for p in parameters)
    optimizer_bytes = counter.add(
        value for state in optimizer.state.values() for value in state.values()
    )
    return Footprint(parameter_bytes, gradient_bytes, optimizer_bytes)
