"""The trainer's input pipeline: default workers per rank, seeded augmentation, --decode gpu's refusal.

The GPU decoding itself runs where a GPU is lent: ``scripts/gpu-check.sh data``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset

from conftest import final_weights, max_difference, run_cli
from nodescale.data.arrays import ArrayDataset
from nodescale.data.augment import Augment, AugmentedDataset
from nodescale.data.base import DatasetSplits
from nodescale.data.epoch_loader import EpochLoader
from nodescale.data.pipeline import input_pipeline
from nodescale.data.section import DataSection
from nodescale.data.sharding import ShardPlan
from nodescale.data.workers import default_workers, rank_cpus
from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

CPU = torch.device("cpu")


def cpus(first: int, count: int) -> frozenset[int]:
    return frozenset(range(first, first + count))


@pytest.mark.parametrize(("mine", "same_node", "expected"), [
    (cpus(0, 8), [cpus(0, 8), cpus(8, 8)], 7),  # bound per rank (srun --cpu-bind=cores): its own 8, less one
    (cpus(0, 16), [cpus(0, 16)] * 4, 3),  # 4 unbound ranks share the node's 16: 4 each, less one
    (cpus(0, 12), [cpus(0, 12), cpus(0, 12), cpus(12, 4)], 5),  # only overlapping sets share
    (cpus(0, 128), [cpus(0, 128)], 16),  # capped
    (cpus(0, 2), [cpus(0, 2)] * 3, 0),  # fewer CPUs than ranks: the main process reads
    (cpus(0, 1), [cpus(0, 1)], 0),
])
def test_default_workers_are_the_ranks_share_of_its_cpus_less_one(mine, same_node, expected) -> None:
    assert default_workers(mine, same_node) == expected


def test_the_trainer_takes_the_default_for_files_and_none_for_arrays_in_memory() -> None:
    one_rank = SimpleNamespace(device=CPU, has_process_group=False, env=SimpleNamespace(node_rank=0))
    files = DatasetSplits(PerSample(ArrayDataset(torch.zeros(4, 3, 2, 2), torch.zeros(4))), Dataset(),
                          InputSpec((3, 2, 2), 2))
    expected = default_workers(rank_cpus(), [rank_cpus()])
    assert input_pipeline(DataSection(name="imagefolder"), files, one_rank, seed=0).workers == expected
    arrays = DatasetSplits(ArrayDataset(torch.zeros(4, 3, 2, 2), torch.zeros(4)), Dataset(), InputSpec((3, 2, 2), 2))
    assert input_pipeline(DataSection(name="cifar10"), arrays, one_rank, seed=0).workers == 0
    assert input_pipeline(DataSection(name="imagefolder", num_workers=3), files, one_rank, seed=0).workers == 3


# ---------------------------------------------------------------- augmentation


def test_a_samples_crop_depends_on_seed_epoch_and_index_alone() -> None:
    augment = Augment(seed=3)
    together = augment.boxes(0, np.arange(200), 32, 24)
    alone = np.concatenate([augment.boxes(0, np.array([i]), 32, 24) for i in (5, 150)])
    assert (alone == together[[5, 150]]).all()  # any batch, rank or worker draws the same crop
    assert (augment.boxes(1, np.arange(200), 32, 24) != together).any(axis=1).mean() > 0.9
    assert (Augment(seed=4).boxes(0, np.arange(200), 32, 24) != together).any(axis=1).mean() > 0.9
    top, left, h, w, flipped = together.T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 32).all() and (left + w <= 24).all()
    area = h * w / (32 * 24)
    assert area.min() >= 0.07 and area.max() <= 1.0 and np.ptp(area) > 0.5
    assert 0.35 < flipped.mean() < 0.65


def test_the_crop_is_its_box_resized_and_the_flip_mirrors() -> None:
    images = torch.rand(1, 3, 16, 16)
    augment = Augment(seed=0, scale=(0.25, 0.25), ratio=(1.0, 1.0), flip=0.0)  # an 8 x 8 box
    top, left, h, w, _ = (int(v) for v in augment.boxes(0, np.array([0]), 16, 16)[0])
    out = augment(images, 0, [0])
    crop = images[:, :, top:top + h, left:left + w]
    expected = F.interpolate(crop, size=(16, 16), mode="bilinear", align_corners=False)
    assert torch.allclose(out[..., 1:-1, 1:-1], expected[..., 1:-1, 1:-1], atol=1e-6)  # edges: the image goes on
    flipped = Augment(seed=0, scale=(0.25, 0.25), ratio=(1.0, 1.0), flip=1.0)(images, 0, [0])
    assert torch.allclose(flipped, out.flip(-1), atol=1e-6)


class PerSample(Dataset):
    """The arrays read one sample at a time, as files are (the workers' path)."""

    def __init__(self, arrays: ArrayDataset) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays)

    def __getitem__(self, index: int):  # noqa: ANN204
        return self.arrays[index]


def test_augmented_batches_are_the_same_in_workers_and_on_the_device_and_resume_exactly() -> None:
    pixels = torch.randint(0, 255, (20, 3, 12, 12), dtype=torch.uint8)
    arrays = ArrayDataset(pixels, torch.arange(20), scale=255.0, mean=(0.5,), std=(0.25,))
    augment = Augment(seed=7)

    def loader(on_device: bool) -> EpochLoader:
        plan = ShardPlan(20, 2, 1, 3, 7, True)
        if on_device:
            return EpochLoader(arrays, plan, pad=True, drop_last=False, grad_accum=1, device=CPU, augment=augment)
        return EpochLoader(AugmentedDataset(PerSample(arrays), augment), plan, pad=True, drop_last=False,
                           grad_accum=1, device=CPU, num_workers=1, persistent_workers=True)

    def epochs(batches: EpochLoader, count: int = 2) -> list[torch.Tensor]:
        return [x for _ in range(count) for x, _ in batches]

    on_device, in_workers = epochs(loader(True)), epochs(loader(False))
    assert len(on_device) == 8
    for a, b in zip(on_device, in_workers, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(on_device[0], on_device[4][:len(on_device[0])])  # epoch 1 crops anew
    unaugmented = [x for x, _ in EpochLoader(arrays, ShardPlan(20, 2, 1, 3, 7, True), pad=True, drop_last=False,
                                               grad_accum=1, device=CPU)]
    assert not torch.allclose(on_device[0], unaugmented[0])
    for on in (True, False):  # stopped after 5 batches (mid-epoch 1), resumed by a new loader
        first = loader(on)
        list(first)
        next(iter(first))
        again = loader(on)
        again.load_state_dict(first.state_dict())
        rest = [x for x, _ in again]
        assert len(rest) == 3
        for a, b in zip(rest, on_device[5:], strict=True):
            assert torch.allclose(a, b, atol=1e-5)


def test_augment_refuses_samples_that_are_not_images() -> None:
    cfg = DataSection(name="regression", augment=True, num_workers=0)
    splits = DatasetSplits(Dataset(), Dataset(), InputSpec((8,), 1))
    with pytest.raises(UserError, match="--augment on dataset 'regression': crops and flips images"):
        input_pipeline(cfg, splits, SimpleNamespace(device=CPU), seed=0)


class Broken(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):  # noqa: ANN204
        raise UserError("image /x/3.jpg", "cannot be decoded (broken data stream)", "remove or replace the file")


def test_a_user_error_in_a_worker_stays_a_user_error() -> None:
    loader = EpochLoader(Broken(), ShardPlan(4, 1, 0, 2, 0, False), pad=True, drop_last=False, grad_accum=1,
                         device=CPU, num_workers=1)
    with pytest.raises(UserError) as caught:
        next(iter(loader))
    assert str(caught.value) == ("image /x/3.jpg: cannot be decoded (broken data stream)\n"
                                 "  hint: remove or replace the file")


# ---------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pipeline")
    rng = np.random.default_rng(0)
    for name in ("ant", "bee"):
        (root / "folder" / name).mkdir(parents=True)
        for i in range(10):
            Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(root / "folder" / name / f"{i}.jpg")
    return root


SGD = ["--dataset", "imagefolder", "--data-dir", "folder", "--nproc", "1", "--model", "cnn", "--batch-size", "4",
       "--optimizer", "sgd", "--lr", "0.05", "--set", "optim.schedule=constant", "--no-progress", "--seed", "3"]


def test_an_augmented_run_resumes_mid_epoch_as_if_never_stopped(folder: Path, tmp_path: Path) -> None:
    # 16 training images, batch 4: 4 steps an epoch; the checkpoint at step 6 is mid-epoch 1. One worker.
    args = ["train", *SGD, "--augment", "--max-steps", "8", "--checkpoint-every", "6",
            "--set", "data.num_workers=1"]
    shutil.copytree(folder / "folder", tmp_path / "folder")
    run_cli([*args, "--out", "whole"], cwd=tmp_path)
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    for saved in (tmp_path / "whole" / "checkpoints").glob("step-00000006*"):
        (shutil.copytree if saved.is_dir() else shutil.copy)(saved, tmp_path / "resumed" / "checkpoints" / saved.name)
    result = run_cli([*args, "--out", "resumed", "--resume"], cwd=tmp_path)
    assert "(step 6)" in result.stdout
    assert max_difference(final_weights(tmp_path / "resumed"), final_weights(tmp_path / "whole")) == 0.0


def test_decode_gpu_without_a_gpu_or_torchvision_exits_2_with_a_hint(folder: Path) -> None:
    result = run_cli(["train", *SGD, "--decode", "gpu", "--max-steps", "1", "--out", "gpu"], cwd=folder, check=False)
    assert result.returncode == 2, result.stderr
    assert "--decode gpu: needs a CUDA GPU (this rank runs on cpu)" in result.stderr
    assert "hint: decode in the DataLoader workers with --decode cpu" in result.stderr
    assert "Traceback" not in result.stderr
