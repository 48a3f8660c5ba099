"""Image datasets decode a batch into one tensor (``read_batch``) instead of stacking samples: the same
values as per-sample reads and the DataLoader's collation, in worker processes too (shared memory),
with unreadable samples black and a mismatched image named. Speed: benchmarks/input_pipeline.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from nodescale.config.schema import DataSection
from nodescale.data.epoch_loader import EpochLoader
from nodescale.data.pack import pack, parse_size
from nodescale.data.registry import get_format
from nodescale.data.sharding import ShardPlan
from nodescale.errors import UserError
from test_shards import write_folder


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODESCALE_CACHE_DIR", str(tmp_path / "cache"))


def load(name: str, location: Path, **fields):  # noqa: ANN201
    cfg = DataSection(name=name, dir=location, **fields)
    fmt = get_format(name)
    fmt.check(cfg)
    fmt.prepare(cfg)
    return fmt.load(cfg, seed=0).train


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("decoded")
    write_folder(root / "folder")
    pack(root / "folder", root / "shards", parse_size("8KB"), workers=1)
    return root


def stacked(dataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    samples = [dataset[i] for i in indices]
    return torch.stack([x for x, _ in samples]), torch.stack([torch.as_tensor(y) for _, y in samples])


@pytest.mark.parametrize("name", ["imagefolder", "shards"])
def test_a_batch_read_whole_equals_the_samples_read_one_by_one(folder: Path, name: str) -> None:
    dataset = load(name, folder / ("folder" if name == "imagefolder" else "shards"))
    indices = [5, 0, 17, 3, 3, 11]
    x, y = dataset.read_batch(indices)
    want_x, want_y = stacked(dataset, indices)
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(x, want_x) and torch.equal(y, want_y)
    assert x.abs().sum() > 0  # real pixels, not an uninitialised buffer that happens to agree


@pytest.mark.parametrize("name", ["imagefolder", "shards"])
def test_worker_processes_hand_over_the_batches_the_default_collation_would(folder: Path, name: str) -> None:
    dataset = load(name, folder / ("folder" if name == "imagefolder" else "shards"))
    plan = ShardPlan.for_dataset(dataset, 1, 0, 5, seed=1, shuffle=True)
    ours = EpochLoader(dataset, plan, pad=False, drop_last=False, grad_accum=1, device=torch.device("cpu"),
                       num_workers=2)
    order = [b.indices[b.weights > 0].tolist() for b in plan.batches(0, 0)]
    theirs = DataLoader(dataset, batch_sampler=order, num_workers=2)
    pairs = list(zip(ours, theirs, strict=True))
    assert len(pairs) == len(order) > 1
    for (x, y), (want_x, want_y) in pairs:
        assert torch.equal(x, want_x) and torch.equal(y, want_y)


def test_unreadable_shard_samples_are_black_in_their_slots(folder: Path, tmp_path: Path) -> None:
    shutil.copytree(folder / "shards", tmp_path / "s")
    victim = tmp_path / "s" / "train-000001.tar"
    victim.write_bytes(victim.read_bytes()[:1500])
    with pytest.warns(UserWarning, match="train-000001.tar"):
        dataset = load("shards", tmp_path / "s", skip_bad_samples=True)
    lost = sorted(dataset.unreadable)
    readable = next(i for i in range(len(dataset)) if i not in dataset.unreadable)
    x, _ = dataset.read_batch([lost[0], readable, lost[-1]])
    assert not x[0].any() and not x[2].any() and torch.equal(x[1], dataset[readable][0])
    assert not dataset.read_batch(lost[:2])[0].any()  # a batch of padding only: black, of the samples' shape


def test_an_image_of_another_size_is_named(folder: Path, tmp_path: Path) -> None:
    shutil.copytree(folder / "folder", tmp_path / "f")
    dataset = load("imagefolder", tmp_path / "f")
    victim = Path(dataset.root) / np.asarray(dataset.paths)[1].decode()
    Image.fromarray(np.zeros((20, 16, 3), np.uint8)).save(victim, format="PNG")
    with pytest.raises(UserError, match=rf"{victim.name}: is 16 x 20 pixels, and the batch's first image 12 x 12"):
        dataset.read_batch([0, 1])


def test_closing_the_run_stops_the_persistent_workers_at_once(folder: Path, tmp_path: Path) -> None:
    """Left to the exit, each persistent worker beside a pin-memory thread (any CUDA run) can cost a 5 s join
    timeout in torch's clean-up (pytorch/pytorch#81794). ``ctx.close()`` tells them to stop first."""
    import nodescale

    ctx = nodescale.init(strategy="single", out=tmp_path / "run")
    loader = ctx.loader(load("imagefolder", folder / "folder"), 5, num_workers=2, persistent_workers=True)
    assert sum(1 for _ in loader) > 1
    workers = list(loader.loader._iterator._workers)
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    ctx.close()
    assert not any(w.is_alive() for w in workers)
