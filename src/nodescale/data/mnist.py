"""MNIST from the four IDX files it is distributed as, raw or gzipped.

Also reads Fashion-MNIST and KMNIST, which use the same files and names. The
files may sit in the given directory or under ``MNIST/raw/`` in it, where
torchvision downloads them. Validation is the 10,000-image t10k test set.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from nodescale.data.base import DatasetSplits
from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    import torch

    from nodescale.data.section import DataSection

MEAN = (0.1307,)
STD = (0.3081,)
SCALE = 255.0

# (images, labels) file names per split, without the optional ".gz".
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# IDX magic numbers: two zero bytes, 0x08 for unsigned bytes, then the number of dimensions.
IMAGES_MAGIC = 0x0803  # 2051
LABELS_MAGIC = 0x0801  # 2049
_KIND = {IMAGES_MAGIC: "an IDX image file", LABELS_MAGIC: "an IDX label file"}
_SUBDIRS = (".", "MNIST/raw")


def locate(root: Path) -> dict[str, Path]:
    """The path of each of the four files, by name without ``.gz``."""
    if not root.is_dir():
        raise UserError(
            f"data directory {root}",
            "does not exist or is not a directory",
            "pass --data-dir DIR holding the MNIST files",
        )
    found: dict[str, Path] = {}
    for names in FILES.values():
        for name in names:
            candidates = [root / sub / f"{name}{ext}" for sub in _SUBDIRS for ext in ("", ".gz")]
            path = next((p for p in candidates if p.is_file()), None)
            if path is not None:
                found[name] = path
    missing = [name for names in FILES.values() for name in names if name not in found]
    if missing:
        raise UserError(
            f"data directory {root}",
            f"lacks the MNIST file{'s' if len(missing) > 1 else ''} {', '.join(missing)} (raw or .gz)",
            "point --data-dir at the directory holding all four IDX files (or their MNIST/raw/ parent)",
        )
    return found


def _read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if data[:2] != b"\x1f\x8b":  # gzip's magic: decide by content, not by name
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as err:
        raise UserError(f"{path}", f"is not a valid gzip file ({err})", "download the file again") from err


def read_idx(path: Path, magic: int, ndim: int) -> torch.Tensor:
    """The uint8 array in the IDX file at ``path``, checked against its header."""
    import torch  # not at the top: see nodescale.data.base

    data = _read_bytes(path)
    header = 4 + 4 * ndim
    if len(data) < header:
        raise UserError(
            f"{path}", f"is truncated: {len(data)} bytes, shorter than an IDX header ({header} bytes)"
        )
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        hint = (
            f"this looks like {_KIND[found]}; are the files swapped?"
            if found in _KIND
            else "download the file again"
        )
        raise UserError(f"{path}", f"has magic number {found}, expected {magic} ({_KIND[magic]})", hint)
    dims = struct.unpack(f">{ndim}I", data[4:header])
    if dims[0] == 0:
        raise UserError(f"{path}", "holds no samples", "download the file again")
    expected = math.prod(dims)
    body = len(data) - header
    if body != expected:
        problem = "is truncated" if body < expected else "is longer than its header says"
        raise UserError(
            f"{path}",
            f"{problem}: {body} bytes of data, expected {expected} for shape {tuple(dims)}",
            "download the file again",
        )
    # bytearray of a memoryview: one copy, into the writable buffer torch wants.
    return torch.frombuffer(bytearray(memoryview(data)[header:]), dtype=torch.uint8).view(dims)


def _read_split(
    paths: dict[str, Path], images_name: str, labels_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    images_path, labels_path = paths[images_name], paths[labels_name]
    images = read_idx(images_path, IMAGES_MAGIC, 3)
    labels = read_idx(labels_path, LABELS_MAGIC, 1)
    if len(images) != len(labels):
        raise UserError(
            f"{images_path} and {labels_path}",
            f"hold {len(images)} images but {len(labels)} labels; expected one label per image",
            "the files come from different downloads; fetch both again",
        )
    return images.unsqueeze(1), labels.long()


class MnistFormat:
    """MNIST (and look-alikes) in memory as ``(N, 1, H, W)`` uint8."""

    name = "mnist"
    needs_dir = True

    def check(self, cfg: DataSection) -> None:
        """All four files are present."""
        locate(_root(cfg))

    def prepare(self, cfg: DataSection) -> None:
        """Nothing to prepare: the files are read whole."""

    def load(self, cfg: DataSection, seed: int) -> DatasetSplits:
        """Training set from train-*, validation set from t10k-*; ``seed`` is not needed."""
        import torch  # not at the top: see nodescale.data.base

        from nodescale.data.arrays import ArrayDataset

        paths = locate(_root(cfg))
        train_x, train_y = _read_split(paths, *FILES["train"])
        val_x, val_y = _read_split(paths, *FILES["val"])
        if train_x.shape[1:] != val_x.shape[1:]:
            raise UserError(
                f"{paths[FILES['val'][0]]}",
                f"holds images of {tuple(val_x.shape[2:])} pixels,"
                f" the training images are {tuple(train_x.shape[2:])}",
                "use the train and t10k files of the same dataset",
            )
        num_classes = int(torch.cat([train_y, val_y]).max()) + 1
        return DatasetSplits(
            train=ArrayDataset(train_x, train_y, scale=SCALE, mean=MEAN, std=STD),
            val=ArrayDataset(val_x, val_y, scale=SCALE, mean=MEAN, std=STD),
            spec=InputSpec(tuple(train_x.shape[1:]), num_classes),
        )


def _root(cfg: DataSection) -> Path:
    if cfg.dir is None:
        raise UserError("dataset 'mnist'", "needs the location of its files", "pass --data-dir DIR")
    return Path(cfg.dir).expanduser()


FORMAT = MnistFormat()
