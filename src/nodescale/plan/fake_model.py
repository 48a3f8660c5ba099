"""Running a model without memory, through torch's private tools, with a fallback for each.

Everything private that the plan touches is here: ``FakeTensorMode`` (tensors with shapes,
dtypes and devices but no storage; the meta device where it is missing) and ``StorageWeakRef``
(a storage's identity, so views and tied weights are counted once). ``tests/test_plan.py`` pins
what the plan relies on, and each fallback, on whichever torch runs it. The plan uses nothing of
``torch.distributed._tools``: the saved-tensor hooks below give the per-block activation bytes it
needs on every torch, and ``RuntimeEstimator`` asserts CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


@contextmanager
def fake_tensors() -> Iterator[Callable[[nn.Module], nn.Module]]:
    """A context in which new tensors take no memory; it gives the function that makes a model's so.

    Models are built on the meta device (initialisers that read values, like ``trunc_normal_``, do
    nothing there), then made FakeTensorMode tensors on the CPU, where autocast works as in training.
    Without FakeTensorMode the meta device serves alone.
    """
    mode = fake_tensor_mode()
    if mode is None:
        with torch.device("meta"):
            yield lambda model: model
        return
    # introspect.forward_flops_per_sample makes a meta sample of its own: allowed in.
    with mode(allow_non_fake_inputs=True):
        yield lambda model: model.to_empty(device="cpu")


def fake_tensor_mode() -> type | None:
    """torch's FakeTensorMode class, or None where this torch lacks it."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:
        return None
    return FakeTensorMode


@contextmanager
def on_meta_device() -> Iterator[None]:
    """Build modules here: parameters with shapes only, initialisers skipped."""
    with torch.device("meta"):
        yield


def storage_key(tensor: torch.Tensor) -> int:
    """An identity of ``tensor``'s storage, the same for every view of it."""
    storage = tensor.untyped_storage()
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return int(StorageWeakRef(storage).cdata)
    except (ImportError, AttributeError):
        return int(storage._cdata)


def storage_bytes(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().nbytes())


@dataclass
class SavedBytes:
    """Bytes of the distinct storages autograd saved for backward, by where they were saved.

    ``blocks[i]``: saved while repeated block ``i`` ran; ``outside``: elsewhere; ``block_inputs[i]``:
    the bytes of block ``i``'s input (what activation checkpointing keeps of it).
    """

    outside: int = 0
    blocks: list[int] = field(default_factory=list)
    block_inputs: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.outside + sum(self.blocks)

    @property
    def checkpointed(self) -> int:
        """Saved bytes with every block recomputed: its input kept, the largest block's saved at once."""
        if not self.blocks:
            return self.total
        return self.outside + sum(self.block_inputs) + max(self.blocks)


@contextmanager
def saved_for_backward(model: nn.Module, blocks: Sequence[nn.Module]) -> Iterator[SavedBytes]:
    """Within it, every tensor saved for backward by ``model``'s forward is counted once (parameters not)."""
    result = SavedBytes(blocks=[0] * len(blocks), block_inputs=[0] * len(blocks))
    seen = {storage_key(p) for p in model.parameters()} | {storage_key(b) for b in model.buffers()}
    current: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in seen:
            seen.add(key)
            if current:
                result.blocks[current[-1]] += storage_bytes(tensor)
            else:
                result.outside += storage_bytes(tensor)
        return tensor

    def entered(index: int) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[object, ...]) -> None:
            current.append(index)
            result.block_inputs[index] = sum(storage_bytes(a) for a in args if isinstance(a, torch.Tensor))
        return hook

    def left(_module: nn.Module, _args: object, _output: object) -> None:
        current.pop()

    handles = [h for i, block in enumerate(blocks)
               for h in (block.register_forward_pre_hook(entered(i)), block.register_forward_hook(left))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield result
    finally:
        for handle in handles:
            handle.remove()
