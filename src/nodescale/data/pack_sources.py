"""What ``nodescale data pack`` reads: the samples of an image folder, MNIST, CIFAR-10 or HDF5, per split.

Each split is listed cheaply (paths, or arrays already in memory, or HDF5 rows) with each
sample's stored size, so shard boundaries are drawn before anything is written; a writer
process then fetches the samples of its shard as their original bytes: an image file's
bytes, or an array row as ``.npy``.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nodescale.data.section import DataSection
from nodescale.errors import UserError

PACKABLE = ("imagefolder", "mnist", "cifar10", "hdf5")


def detect_format(path: Path) -> str:
    """The built-in format of the dataset at ``path``, by its files."""
    if path.is_file():
        return "hdf5" if path.suffix.lower() in (".h5", ".hdf5", ".hdf") else "shards"
    if not path.is_dir():
        return "shards"  # a glob or brace list of shards
    names = set(os.listdir(path))
    if "manifest.json" in names or any(name.endswith(".tar") for name in names):
        return "shards"
    if names & {"train-images-idx3-ubyte", "train-images-idx3-ubyte.gz", "MNIST"}:
        return "mnist"
    if "data_batch_1" in names or "cifar-10-batches-py" in names:
        return "cifar10"
    return "imagefolder"


@dataclass
class SplitItems:
    """One split's samples: labels, stored sizes, and how a writer fetches them (``fetch``)."""

    labels: np.ndarray
    sizes: np.ndarray  # bytes of each sample's data member
    kind: str  # "files", "array" or "hdf5"
    source: Any  # files: (root, relative paths); array: the array; hdf5: (path, images key, rows)
    exts: list[str] = field(default_factory=list)  # files: each one's extension


@dataclass
class PackSource:
    format: str
    classes: list[str]
    splits: dict[str, SplitItems]
    normalise: dict[str, Any] | None  # how arrays are scaled and standardised (the source format's way)


def _npy_size(row: np.ndarray) -> int:
    buffer = io.BytesIO()
    np.save(buffer, row, allow_pickle=False)
    return len(buffer.getvalue())


def _arrays(x: np.ndarray, y: np.ndarray) -> SplitItems:
    size = _npy_size(x[0]) if len(x) else 0
    return SplitItems(y.astype(np.int64), np.full(len(x), size, dtype=np.int64), "array", x)


def _folder(path: Path) -> PackSource:
    from nodescale.data.imagefolder import _samples, scan

    index = scan(path.resolve(), check_size=False)
    splits = {}
    for name, group in (("train", index.train), ("val", index.val)):
        if group is not None:
            paths, labels = _samples(index, group)
            names = [os.fsdecode(p) for p in paths]
            sizes = np.array([os.path.getsize(os.path.join(index.root, n)) for n in names], dtype=np.int64)
            exts = [n.rpartition(".")[2].lower() for n in names]
            splits[name] = SplitItems(labels, sizes, "files", (index.root, names), exts)
    return PackSource("imagefolder", index.classes, splits, None)


def _in_memory(name: str, path: Path) -> PackSource:
    from nodescale.data.registry import get_format

    loaded = get_format(name).load(DataSection(name=name, dir=path), seed=0)  # both have their own test split
    splits = {split: _arrays(ds.x.numpy(), ds.y.numpy()) for split, ds in (("train", loaded.train),
                                                                           ("val", loaded.val))}
    train = loaded.train
    normalise = {"scale": train.scale, "mean": list(train.mean), "std": list(train.std)}  # type: ignore[attr-defined]
    return PackSource(name, [str(c) for c in range(loaded.spec.num_classes)], splits, normalise)


def _hdf5(path: Path) -> PackSource:
    from nodescale.data.hdf5 import IMAGENET_MEAN, IMAGENET_STD, _read_part, find_keys, open_file

    with open_file(path) as file:
        train_keys, val_keys = find_keys(file, path)
        parts = {"train": _read_part(file, train_keys, path)}
        if val_keys is not None:
            parts["val"] = _read_part(file, val_keys, path)
        splits = {}
        for split, part in parts.items():
            images = file[part.images_key]
            row = np.asarray(images[0])
            labels = part.labels.numpy()
            splits[split] = SplitItems(labels, np.full(len(labels), _npy_size(row), dtype=np.int64), "hdf5",
                                       (str(path), part.images_key))
    layout = parts["train"].layout
    channels = layout.shape[0]
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.5,) * channels, (0.5,) * channels)
    labels = np.concatenate([s.labels for s in splits.values()])
    normalise = {"scale": layout.scale, "mean": list(mean), "std": list(std), "hwc": layout.hwc,
                 "shape": list(layout.shape)}
    return PackSource("hdf5", [str(c) for c in range(int(labels.max()) + 1)], splits, normalise)


def read_source(path: Path, name: str | None) -> PackSource:
    """The samples of the dataset at ``path`` (format ``name``, or detected)."""
    if not path.exists():
        raise UserError(f"source {path}", "does not exist", "pass an image folder, MNIST or CIFAR-10 directory, "
                        "or an HDF5 file")
    name = name or detect_format(path)
    if name not in PACKABLE:
        raise UserError(f"source {path}", f"is a {name} dataset, which data pack does not read",
                        f"pack an image folder, MNIST, CIFAR-10 or HDF5 ({', '.join(PACKABLE)})")
    if name == "imagefolder":
        if not path.is_dir():
            raise UserError(f"source {path}", "is not a directory", "pass an image folder: SRC/<class>/<image>")
        return _folder(path)
    return _hdf5(path) if name == "hdf5" else _in_memory(name, path)


def part(items: SplitItems, start: int, stop: int) -> SplitItems:
    """Samples ``start:stop`` alone: what one writer process is sent (not the whole array)."""
    if items.kind == "files":
        source: Any = (items.source[0], items.source[1][start:stop])
    elif items.kind == "array":
        source = items.source[start:stop]
    else:
        source = (*items.source[:2], start, stop)
    return SplitItems(items.labels[start:stop], items.sizes[start:stop], items.kind, source, items.exts[start:stop])


def fetch(items: SplitItems) -> list[tuple[str, bytes]]:
    """The (extension, original bytes) of every sample of ``items``: in a writer process."""
    if items.kind == "files":
        root, names = items.source
        out = []
        for name, ext in zip(names, items.exts, strict=True):
            with open(os.path.join(root, name), "rb") as handle:
                out.append((ext, handle.read()))
        return out
    if items.kind == "array":
        rows = items.source
    else:
        from nodescale.data.hdf5 import open_file

        path, key, start, stop = items.source
        with open_file(path) as file:
            rows = np.asarray(file[key][start:stop])
    out = []
    for row in rows:
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(row), allow_pickle=False)
        out.append(("npy", buffer.getvalue()))
    return out
