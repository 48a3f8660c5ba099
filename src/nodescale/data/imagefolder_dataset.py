"""Samples of the imagefolder format, decoded from their files one item at a time.

Apart from ``nodescale.data.imagefolder`` because it needs torch, which the
launcher's ``check`` must not import; ``ImageFolderFormat.load`` imports it.
"""

from __future__ import annotations

import io
import os
from typing import BinaryIO

import numpy as np
import torch
from torch.utils.data import Dataset

from nodescale.data.decoded_batches import batch_tensor
from nodescale.data.imagefolder import MEAN, STD
from nodescale.errors import UserError

# (x / 255 - mean) / std as x * _SCALE + _SHIFT
_SCALE = 1.0 / (255.0 * torch.tensor(STD).view(3, 1, 1))
_SHIFT = -torch.tensor(MEAN).view(3, 1, 1) / torch.tensor(STD).view(3, 1, 1)


class ImageFolderDataset(Dataset):
    """Images decoded from files per item, as normalised float32 ``(3, H, W)`` and int64 labels."""

    def __init__(self, root: str, paths: np.ndarray, labels: np.ndarray, image_size: int | None) -> None:
        # Paths as one numpy bytes array, not a list of str: DataLoader workers
        # touching millions of Python objects would copy their pages (refcounts).
        self.root = root
        self.paths = paths
        self.labels = labels
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return normalised(self._pixels(index)[1]), torch.tensor(self.labels[index], dtype=torch.int64)

    def read_batch(self, indices: list[int]) -> list[torch.Tensor]:
        """The images at ``indices`` as one standardised batch and their labels, each decoded into its slot."""
        out = None
        for slot, index in enumerate(indices):
            path, pixels = self._pixels(index)
            if out is None:
                out = batch_tensor(len(indices), (3, *pixels.shape[:2]))
            elif pixels.shape[:2] != out.shape[2:]:
                raise UserError(path, f"is {pixels.shape[1]} x {pixels.shape[0]} pixels, and the batch's first image "
                                f"{out.shape[3]} x {out.shape[2]}", "pass --set data.image_size=N to crop and resize "
                                "every image to N x N")
            normalised(pixels, out=out[slot])
        return [out, torch.from_numpy(self.labels[np.asarray(indices, dtype=np.int64)].astype(np.int64))]

    def _pixels(self, index: int) -> tuple[str, np.ndarray]:
        path, data = self._read(index)
        try:
            return path, decode(io.BytesIO(data), self.image_size)
        except OSError as err:
            raise UserError(f"{path}", f"cannot be decoded ({err})", "remove or replace the file") from err

    def encoded(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The file's bytes, undecoded (``--decode gpu`` decodes a batch of them on the device), and its label."""
        _, data = self._read(index)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), torch.tensor(self.labels[index], dtype=torch.int64)

    def _read(self, index: int) -> tuple[str, bytes]:
        # The whole file in one read, decoded from memory: PIL reading a file object in small pieces
        # was 0.7x the images/s in DataLoader workers, and a parallel filesystem prefers one large read.
        path = os.path.join(self.root, os.fsdecode(self.paths[index]))
        try:
            with open(path, "rb") as file:
                return path, file.read()
        except OSError as err:
            raise UserError(f"{path}", f"cannot be read ({err})", "check the file's permissions, or remove it") \
                from err


def normalised(pixels: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 RGB ``(H, W, 3)`` as float32 ``(3, H, W)`` standardised with ImageNet's mean and std (into ``out``)."""
    # Made contiguous while still uint8, then one fused pass: elementwise work on the permuted
    # (channel-last) strides cost three times the JPEG decode (benchmarks/input_pipeline.py).
    x = torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1))).float()
    return torch.addcmul(_SHIFT, x, _SCALE, out=out)


def decode(path: str | BinaryIO, image_size: int | None) -> np.ndarray:
    """The image at ``path`` (or in a file object) as uint8 RGB ``(H, W, 3)``; cropped and resized to
    ``image_size`` if given."""
    from PIL import Image, ImageOps  # imported once per process, then a dictionary look-up

    with Image.open(path) as img:
        if image_size is not None:
            # JPEG only: decode at a reduced scale that still covers the target (fast for big photos).
            img.draft("RGB", (image_size, image_size))
        if img.mode != "RGB":  # convert() copies even an RGB image
            img = img.convert("RGB")
        if image_size is not None and img.size != (image_size, image_size):
            # Centre crop to a square, then resize: no distortion of the aspect ratio.
            img = ImageOps.fit(img, (image_size, image_size), Image.Resampling.BILINEAR)
        return np.array(img, dtype=np.uint8)  # a writable copy, which torch.from_numpy wants
