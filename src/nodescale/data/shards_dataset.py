"""Samples of the shards format, read by offset from their tar shard and decoded one at a time.

Apart from ``nodescale.data.shards`` because it needs torch, which the launcher's ``check``
must not import. Images are decoded and standardised as the imagefolder format does them, so
a packed folder trains to the same weights; ``.npy`` arrays are scaled as the manifest says
(``nodescale data pack`` records the source format's mean and std).
"""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from nodescale.data.base import DatasetSplits
from nodescale.data.decoded_batches import batch_tensor
from nodescale.data.imagefolder import _pil
from nodescale.data.imagefolder_dataset import decode, normalised
from nodescale.data.stage import stage_file
from nodescale.data.tar_index import DATA_EXTENSIONS, IMAGE_EXTENSIONS
from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from nodescale.data.section import DataSection
    from nodescale.data.sharding import ShardPlan
    from nodescale.data.shards import ShardSamples

UNREADABLE = -1  # the extension code of a sample lost to a damaged shard


class ShardsDataset(Dataset):
    """Samples of tar shards in stored order, shard after shard (``sample_groups`` tells ``ctx.loader``)."""

    def __init__(self, paths: list[str], columns: dict[str, np.ndarray], image_size: int | None,
                 normalise: dict[str, Any] | None, checksums: dict[str, str], stage_dir: str | None) -> None:
        # One numpy array per column, not Python objects per sample: DataLoader workers would copy
        # the pages that reference counts touch.
        self.sources = list(paths)  # where the shards are; ``paths``: where they are read (staged copies)
        self.paths = list(paths)
        self.columns = columns  # shard, offset, size, ext (code into DATA_EXTENSIONS), label, key
        self.image_size = image_size
        self.normalise = normalise or {}
        self.checksums = checksums  # by shard file name, from the manifest
        self.stage_dir = stage_dir
        self.shape: tuple[int, ...] | None = None  # every sample's; set from the first one read
        self._fds: dict[str, int] = {}
        self._pid = -1

    def __len__(self) -> int:
        return len(self.columns["shard"])

    @property
    def sample_groups(self) -> tuple[int, ...]:
        """Lengths of the runs of samples stored in one shard, in order."""
        _, counts = np.unique(self.columns["shard"], return_counts=True)  # shards ascend in stored order
        return tuple(int(c) for c in counts)

    @property
    def unreadable(self) -> frozenset[int]:
        return frozenset(np.flatnonzero(self.columns["ext"] == UNREADABLE).tolist())

    def subset(self, rows: np.ndarray) -> ShardsDataset:
        """The samples at ``rows`` (ascending, so shards stay contiguous)."""
        columns = {name: column[rows] for name, column in self.columns.items()}
        return ShardsDataset(self.sources, columns, self.image_size, self.normalise, self.checksums, self.stage_dir)

    def stage_shards(self, plan: ShardPlan) -> None:
        """Copy the shards this rank reads to ``data.stage`` (node-local disk) and read them there."""
        if self.stage_dir is None:
            return
        mine = plan.padded(0)[plan.rank::plan.world_size].numpy()  # the same shards every epoch
        for shard in np.unique(self.columns["shard"][mine]).tolist():
            source = self.sources[shard]
            self.paths[shard] = stage_file(source, self.stage_dir, self.checksums.get(os.path.basename(source)))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.read_batch([index], shared=False)
        return x[0], y[0]

    def read_batch(self, indices: list[int], shared: bool | None = None) -> list[torch.Tensor]:
        """The samples at ``indices`` as one standardised batch and its labels, each decoded into its slot."""
        rows = np.asarray(indices, dtype=np.int64)
        out = None
        for slot, index in enumerate(rows.tolist()):
            if int(self.columns["ext"][index]) == UNREADABLE:  # weighs 0 (ShardPlan.unreadable): a black image
                continue
            sample = self._decoded(index)
            shape = (3, *sample.shape[:2]) if isinstance(sample, np.ndarray) else tuple(sample.shape)
            if self.shape is None:
                self.shape = shape
            if shape != self.shape:
                raise UserError(self._name(index), f"has shape {shape} but the first sample {self.shape}",
                                "pass --set data.image_size=N to crop and resize every image to N x N")
            if out is None:
                out = batch_tensor(len(rows), shape, shared)
            if isinstance(sample, np.ndarray):
                normalised(sample, out=out[slot])
            else:
                out[slot].copy_(sample)
        if out is None:  # only unreadable samples: a rank's lone padding sample
            assert self.shape is not None
            out = batch_tensor(len(rows), self.shape, shared)
        for slot in np.flatnonzero(self.columns["ext"][rows] == UNREADABLE).tolist():
            out[slot].zero_()
        return [out, torch.from_numpy(self.columns["label"][rows])]

    def encoded(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sample's stored bytes, undecoded (``--decode gpu`` decodes a batch on the device), and its label."""
        label = torch.tensor(int(self.columns["label"][index]), dtype=torch.int64)
        if int(self.columns["ext"][index]) == UNREADABLE:  # weighs 0; decoded as a black image
            return torch.zeros(0, dtype=torch.uint8), label
        return torch.frombuffer(bytearray(self._bytes(index)), dtype=torch.uint8), label

    def _bytes(self, index: int) -> bytes:
        path = self.paths[int(self.columns["shard"][index])]
        return os.pread(self._fd(path), int(self.columns["size"][index]), int(self.columns["offset"][index]))

    def decode(self, index: int) -> torch.Tensor:
        """The input of sample ``index``, standardised."""
        sample = self._decoded(index)
        return normalised(sample) if isinstance(sample, np.ndarray) else sample

    def _decoded(self, index: int) -> np.ndarray | torch.Tensor:
        """An image as uint8 RGB ``(H, W, 3)`` (standardised by ``normalised``); an array, standardised."""
        ext = DATA_EXTENSIONS[int(self.columns["ext"][index])]
        data = self._bytes(index)
        try:
            if ext in IMAGE_EXTENSIONS:
                return decode(io.BytesIO(data), self.image_size)
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except (OSError, ValueError) as err:
            raise UserError(self._name(index), f"cannot be decoded as .{ext} ({err})",
                            "re-create the shard, or remove the sample") from err
        x = torch.from_numpy(np.array(array)).float()
        if self.normalise.get("hwc"):  # stored as the HDF5 file holds it: (H, W, C)
            x = x.permute(2, 0, 1)
        if "shape" in self.normalise:
            x = x.reshape(self.normalise["shape"])
        scale = float(self.normalise.get("scale", 255.0 if array.dtype == np.uint8 else 1.0))
        mean = torch.tensor(self.normalise.get("mean", (0.0,)), dtype=torch.float32)
        std = torch.tensor(self.normalise.get("std", (1.0,)), dtype=torch.float32)
        shape = (-1,) + (1,) * (x.dim() - 1) if x.dim() > 1 else (-1,)  # per channel, ArrayDataset's way
        return (x / scale - mean.view(shape)) / std.view(shape)

    def _fd(self, path: str) -> int:
        if self._pid != os.getpid():  # descriptors inherited through fork are shared: open our own
            self._fds, self._pid = {}, os.getpid()
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def _name(self, index: int) -> str:
        key = self.columns["key"][index].decode("utf-8", "replace")
        return f"shard {self.paths[int(self.columns['shard'][index])]}, sample {key}"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fds"], state["_pid"] = {}, -1  # spawned workers open their own
        return state


def _columns(samples: ShardSamples) -> dict[str, np.ndarray]:
    shard, offset, size, ext, label, key = [], [], [], [], [], []
    for number, (index, expected) in enumerate(zip(samples.indexes, samples.expected, strict=True)):
        lost = expected - len(index.keys)
        shard += [number] * expected
        offset += index.offsets + [0] * lost
        size += index.sizes + [0] * lost
        ext += [DATA_EXTENSIONS.index(e) for e in index.exts] + [UNREADABLE] * lost
        label += index.labels + [0] * lost
        key += [k.encode() for k in index.keys] + [b"?"] * lost
    return {"shard": np.array(shard, dtype=np.int32), "offset": np.array(offset, dtype=np.int64),
            "size": np.array(size, dtype=np.int64), "ext": np.array(ext, dtype=np.int8),
            "label": np.array(label, dtype=np.int64), "key": np.array(key, dtype=np.bytes_)}


def _dataset(samples: ShardSamples, manifest: dict[str, Any] | None, cfg: DataSection) -> ShardsDataset:
    checksums = {s["name"]: s["sha256"] for split in (manifest or {}).get("splits", {}).values()
                 for s in split.get("shards", []) if "sha256" in s}
    return ShardsDataset(samples.paths, _columns(samples), cfg.image_size, (manifest or {}).get("normalise"),
                         checksums, None if cfg.stage is None else str(cfg.stage))


def load_splits(train: ShardSamples, val: ShardSamples | None, manifest: dict[str, Any] | None,
                cfg: DataSection, seed: int) -> DatasetSplits:
    """The training and validation sets of the shards, with the spec of their samples."""
    from nodescale.data.split import seeded_split

    train_set = _dataset(train, manifest, cfg)
    if len(train_set) == 0:
        raise UserError(f"shards {train.paths[0]}, ...", "hold no samples", "check --data-dir")
    if val is not None:
        val_set = _dataset(val, manifest, cfg)
    else:
        train_rows, val_rows = seeded_split(len(train_set), cfg.val_fraction, seed)
        train_set, val_set = train_set.subset(train_rows.numpy()), train_set.subset(val_rows.numpy())
    readable = np.flatnonzero(train_set.columns["ext"] != UNREADABLE)
    if not len(readable):
        raise UserError(f"shards {train.paths[0]}, ...", "hold no readable training sample", "check the shards")
    first = readable[0]
    if any(DATA_EXTENSIONS[int(e)] in IMAGE_EXTENSIONS for e in np.unique(train_set.columns["ext"]) if e >= 0):
        _pil()  # Pillow is needed: say how to install it before a worker fails
    shape = tuple(train_set.decode(int(first)).shape)
    train_set.shape = val_set.shape = shape
    labels = np.concatenate([train_set.columns["label"], val_set.columns["label"]])
    classes = (manifest or {}).get("classes")
    num_classes = len(classes) if classes else int(labels.max()) + 1
    if labels.min() < 0 or labels.max() >= num_classes:
        raise UserError(f"shards {train.paths[0]}, ...", f"hold labels from {labels.min()} to {labels.max()}",
                        f"labels must be classes 0..{num_classes - 1} (the manifest lists {num_classes} classes)")
    return DatasetSplits(train_set, val_set, InputSpec(shape, num_classes))
