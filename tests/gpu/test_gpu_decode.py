"""--decode gpu on a real CUDA device: nvJPEG through torchvision against the CPU path, augmentation on
the device against the workers', and a training run on GPU-decoded, augmented batches.

Skipped without CUDA (see conftest.py) or torchvision; ``scripts/gpu-check.sh data`` runs them.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import read_summary, run_cli
from nodescale.data.augment import Augment
from nodescale.data.gpu_decode import GpuDecoder
from nodescale.data.imagefolder_dataset import decode, normalised

pytestmark = pytest.mark.gpu
try:  # a torchvision built for another torch fails at import with any error, not only ImportError
    import torchvision.io  # noqa: F401
except Exception:  # noqa: BLE001
    pytest.skip("--decode gpu needs a torchvision that imports with this torch", allow_module_level=True)
CUDA = torch.device("cuda")


def _jpeg(rng: np.random.Generator, height: int, width: int) -> bytes:
    """Full-resolution colour (4:4:4): nvJPEG and libjpeg then decode the same pixels. With 4:2:0 they
    upsample the colour differently (5.5 levels in the mean, 34 at most on these hard edges: H100, 2026-11-27)."""
    coarse = Image.fromarray(rng.integers(0, 255, (6, 6, 3), dtype=np.uint8)).resize((width, height))
    buffer = io.BytesIO()
    coarse.save(buffer, format="JPEG", quality=95, subsampling=0)
    return buffer.getvalue()


@pytest.mark.parametrize("image_size", [None, 32])
def test_gpu_decoding_matches_the_cpu_path(image_size: int | None) -> None:
    rng = np.random.default_rng(0)
    shapes = [(48, 48)] * 4 if image_size is None else [(48, 64), (64, 40), (32, 32), (100, 90)]
    files = [_jpeg(rng, h, w) for h, w in shapes]
    png = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (48, 48, 3), dtype=np.uint8)).save(png, format="PNG")
    files.append(png.getvalue())  # decoded on the CPU by torchvision, moved to the GPU
    encoded = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in files]
    side = image_size or 48
    decoder = GpuDecoder(CUDA, image_size, (3, side, side))
    gpu, labels = decoder([encoded, torch.arange(len(files))])
    cpu = torch.stack([normalised(decode(io.BytesIO(f), image_size)) for f in files])
    assert gpu.device.type == "cuda" and gpu.shape == cpu.shape and labels.tolist() == list(range(len(files)))
    difference = (gpu.cpu() - cpu).abs() * 0.229 * 255  # back to pixel levels (the largest std: an upper bound)
    if image_size is None:  # the same decoded pixels, standardised in float32 by both
        assert difference.max() < 0.01
    else:  # two antialiased bilinear resamplers, each rounding to uint8: a few levels apart on hard edges
        assert difference.mean() < 1.0 and difference.max() < 8.0


def test_augmentation_on_the_gpu_matches_the_cpu() -> None:
    images = torch.rand(16, 3, 32, 32)
    augment = Augment(seed=5)
    indices = np.arange(100, 116)
    assert torch.allclose(augment(images.to(CUDA), 3, indices).cpu(), augment(images, 3, indices), atol=1e-4)


def test_training_on_gpu_decoded_augmented_shards(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    for name in ("ant", "bee"):
        (tmp_path / "folder" / name).mkdir(parents=True)
        for i in range(24):
            (tmp_path / "folder" / name / f"{i}.jpg").write_bytes(_jpeg(rng, 40, 52))
    run_cli(["data", "pack", "folder", "--out", "shards", "--shard-size", "16KB"], tmp_path)
    for dataset, where in (("imagefolder", "folder"), ("shards", "shards")):
        out = tmp_path / f"run-{dataset}"
        run_cli(["train", "--dataset", dataset, "--data-dir", where, "--nproc", "1", "--model", "cnn",
                 "--batch-size", "8", "--max-steps", "6", "--decode", "gpu", "--augment", "--set",
                 "data.image_size=32", "--out", str(out), "--no-progress"], tmp_path, timeout=120)
        summary = read_summary(out)
        assert summary["global_steps"] == 6 and np.isfinite(summary["val_loss"]), summary
