"""Checkpoint files that may come from anyone, read without running code from them.

A pickle may call any function it names while it loads. ``torch.load(weights_only=True)``
lets it name only tensors, plain containers and the classes a caller allow-lists.
torch.distributed.checkpoint's ``.metadata`` is a plain pickle of protocol 4, which torch's
weights-only unpickler cannot read; it is read here by an unpickler that finds only the
metadata's own classes. ``checkpoint export`` and ``info`` read through this module unless the
user passes ``--trust-checkpoint``; a run resuming its own checkpoints (checked against their
manifest first) uses the libraries' loaders.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import torch

from nodescale.errors import UserError

TRUST_HINT = ("pass --trust-checkpoint to load it as the program that wrote it would, only if you trust where it "
              "came from: loading it can run code it holds")

# torch.distributed.checkpoint's metadata: module -> the names its pickle may use (torch's dtypes besides).
_DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
}


def refused(where: str, exc: BaseException) -> UserError:
    """The error for file ``where`` whose pickle names something outside the allow-list (``exc``)."""
    named = re.search(r"GLOBAL ([\w.]+)", str(exc))
    what = f"an object of {named.group(1)}" if named else "objects other than tensors and plain data"
    return UserError(f"checkpoint file {where}", f"holds {what}, which a weights-only load refuses", TRUST_HINT)


def load_weights(source: Path | IO[bytes], where: str | None = None, allowed: Iterable[Any] = (),
                 **options: Any) -> Any:
    """``torch.load(source, weights_only=True)`` on the CPU, ``allowed`` classes besides; a ``UserError``
    naming the file (``where``: what to call it, default its path) when it holds anything else or is unreadable."""
    where = where or str(source)
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(source, map_location="cpu", weights_only=True, **options)
    except pickle.UnpicklingError as exc:
        raise refused(where, exc) from None
    except Exception as exc:  # truncated, not a torch file: say which and why
        raise UserError(f"checkpoint file {where}", f"does not load ({type(exc).__name__}: {exc})",
                        "pick another checkpoint of the run") from None


class _MetadataUnpickler(pickle.Unpickler):
    """Finds the classes of torch.distributed.checkpoint's metadata and torch's dtypes; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_GLOBALS.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


def dcp_reader(directory: Path, trust: bool = False) -> Any:
    """A ``FileSystemReader`` of the torch.distributed.checkpoint directory; unless ``trust``, one whose
    metadata is read by an allow-listing unpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    if trust:
        return FileSystemReader(directory)

    class AllowListReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            # FileSystemReader.read_metadata with the unpickler swapped: the rest as torch does it.
            path = self._get_metadata_path(kwargs.get("rank"))
            try:
                with self.fs.create_stream(path, "rb") as stream:
                    metadata = _MetadataUnpickler(stream).load()
            except pickle.UnpicklingError as exc:
                raise refused(str(path), exc) from None
            except Exception as exc:  # truncated or not a pickle
                raise UserError(f"checkpoint file {path}", f"does not load ({type(exc).__name__}: {exc})",
                                "pick another checkpoint of the run") from None
            if not isinstance(metadata, Metadata):
                raise UserError(f"checkpoint file {path}", "is not torch.distributed.checkpoint metadata",
                                "pass a checkpoint written by nodescale train")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return AllowListReader(directory)


def dcp_model_planner(directory: Path, trust: bool = False) -> Any:
    """A load planner for the ``model`` entries of a torch.distributed.checkpoint directory, without a
    process group; unless ``trust``, its non-tensor items are loaded weights-only (torch's planner
    unpickles them with ``weights_only=False``)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    if trust:
        return _EmptyStateDictLoadPlanner(keys={"model"})

    class WeightsOnlyPlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # Loaded weights-only, saved again: what torch's planner then unpickles is plain data of ours.
            plain = io.BytesIO()
            torch.save(load_weights(value, f"{directory} (item {read_item.dest_index.fqn})"), plain)
            plain.seek(0)
            super().load_bytes(read_item, plain)

    return WeightsOnlyPlanner(keys={"model"})
