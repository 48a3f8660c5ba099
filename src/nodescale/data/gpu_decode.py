"""``--decode gpu``: DataLoader workers only read the image files' bytes; the rank decodes a whole batch
of JPEGs on its GPU (nvJPEG, through ``torchvision.io.decode_jpeg(device="cuda")``).

Images are then fitted to ``data.image_size`` as the CPU path fits them (the largest centred square,
resized) and standardised with the same mean and std, so a run may switch decoders. Other files
(PNG, ...) in the batch are decoded on the CPU by torchvision and moved to the GPU.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from nodescale.data.imagefolder import MEAN, STD
from nodescale.errors import UserError

_JPEG_MAGIC = b"\xff\xd8\xff"


def torchvision_io(device: torch.device) -> Any:
    """``torchvision.io``, where GPU decoding can run on ``device``; else a ``UserError`` saying what is missing."""
    missing = []
    if device.type != "cuda":
        missing.append(f"a CUDA GPU (this rank runs on {device.type})")
    try:
        io = importlib.import_module("torchvision.io")
    except Exception as err:  # noqa: BLE001 - torchvision built for another torch fails with any error at import
        io = None
        missing.append(f"torchvision ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no message'})")
    if missing:
        raise UserError("--decode gpu", f"needs {' and '.join(missing)}",
                        "decode in the DataLoader workers with --decode cpu, or install the torchvision wheel "
                        "built for this torch (pip install torchvision==<the matching version>) on a GPU node")
    return io


class EncodedDataset(Dataset):
    """``dataset``'s samples as their files' undecoded bytes (``dataset.encoded``) and labels."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)  # sample_groups, unreadable, stage_shards, for the plan

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset.encoded(index)  # type: ignore[attr-defined, no-any-return]


def collate_encoded(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
    """A batch of byte strings of different lengths: a list of them, and the labels stacked."""
    return [[data for data, _ in samples], torch.stack([label for _, label in samples])]


class GpuDecoder:
    """A batch ``[list of encoded images, labels]`` -> ``[float32 (N, 3, S, S) on the GPU, labels]``."""

    def __init__(self, device: torch.device, image_size: int | None, shape: tuple[int, ...]) -> None:
        self.io = torchvision_io(device)
        self.device = device
        self.image_size = image_size
        self.shape = shape  # every sample's (3, H, W), for the black image of an unreadable sample
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1)

    def __call__(self, batch: list[Any]) -> list[Any]:
        encoded, labels = batch
        images: list[torch.Tensor | None] = [None] * len(encoded)
        jpegs = [i for i, data in enumerate(encoded) if bytes(data[:3].tolist()) == _JPEG_MAGIC]
        if jpegs:  # one call: nvJPEG decodes the batch together
            decoded = self.io.decode_jpeg([encoded[i] for i in jpegs], mode=self.io.ImageReadMode.RGB,
                                          device=self.device)
            for i, image in zip(jpegs, decoded, strict=True):
                images[i] = image
        for i, data in enumerate(encoded):
            if images[i] is None and len(data):
                images[i] = self.io.decode_image(data, mode=self.io.ImageReadMode.RGB).to(self.device)
        fitted = torch.stack([self._fitted(image) for image in images])
        return [(fitted.float().div_(255.0) - self.mean) / self.std, labels]

    def _fitted(self, image: torch.Tensor | None) -> torch.Tensor:
        """uint8 ``(3, H, W)`` cut to its largest centred square and resized to ``image_size`` (as ``ImageOps.fit``)."""
        if image is None:  # a sample of a damaged shard (weight 0)
            return torch.zeros(self.shape, dtype=torch.uint8, device=self.device)
        size = self.image_size
        if size is None or tuple(image.shape[-2:]) == (size, size):
            return image
        _, height, width = image.shape
        side = min(height, width)
        top, left = (height - side) // 2, (width - side) // 2
        square = image[:, top:top + side, left:left + side].float()
        resized = F.interpolate(square[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        return resized[0].round_().clamp_(0, 255).to(torch.uint8)
