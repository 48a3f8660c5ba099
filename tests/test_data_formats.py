"""Every dataset format, loaded from real files in its real format written here.

The files are small but byte-for-byte what the datasets ship as: IDX written
with struct (raw and gzipped), CIFAR pickles, PNG/JPEG class folders, HDF5 in
each supported layout. Every bad input must end in a ``UserError`` that names
the file.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import tokenizers
import torch
from PIL import Image
from torch.utils.data import DataLoader

import nodescale
from nodescale.config.schema import DataSection
from nodescale.data import cifar10, digits, imagefolder
from nodescale.data.arrays import ArrayDataset
from nodescale.data.registry import DATASETS, get_format
from nodescale.data.split import seeded_split
from nodescale.errors import UserError

CPU = torch.device("cpu")
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406])
IMAGENET_STD = np.array([0.229, 0.224, 0.225])


def load(name: str, seed: int = 0, **fields):
    """Check and load dataset ``name`` through the registry."""
    cfg = DataSection(name=name, **fields)
    fmt = get_format(name)
    fmt.check(cfg)
    fmt.prepare(cfg)
    return fmt.load(cfg, seed)


def inputs(dataset) -> torch.Tensor:
    """All normalised inputs of ``dataset``, stacked."""
    if isinstance(dataset, ArrayDataset):
        return dataset.get_batch(torch.arange(len(dataset)), CPU)[0]
    return torch.stack([dataset[i][0] for i in range(len(dataset))])


def labels(dataset) -> torch.Tensor:
    if isinstance(dataset, ArrayDataset):
        return dataset.y
    return torch.stack([dataset[i][1] for i in range(len(dataset))])


def pixels_around(rng: np.random.Generator, shape: tuple[int, ...], mean, std) -> np.ndarray:
    """uint8 pixels drawn with per-channel (last axis) ``mean``/``std`` given in 0..1 units."""
    values = rng.normal(np.asarray(mean) * 255, np.asarray(std) * 255, size=shape)
    return np.clip(np.rint(values), 0, 255).astype(np.uint8)


def assert_names(err: pytest.ExceptionInfo, path: Path | str) -> None:
    assert str(path) in str(err.value), f"{path} not named in: {err.value}"


# ---------------------------------------------------------------- registry, split


def test_every_registered_format_matches_its_entry():
    for name, entry in DATASETS.items():
        fmt = get_format(name)
        assert fmt.name == name
        assert fmt.needs_dir == entry.needs_dir


def test_seeded_split_partitions_reproducibly():
    train, val = seeded_split(100, 0.2, seed=3)
    assert train.dtype == val.dtype == torch.int64
    assert len(val) == 20 and len(train) == 80
    assert sorted(torch.cat([train, val]).tolist()) == list(range(100))
    again = seeded_split(100, 0.2, seed=3)
    assert torch.equal(train, again[0]) and torch.equal(val, again[1])
    assert not torch.equal(val, seeded_split(100, 0.2, seed=4)[1])


def test_seeded_split_keeps_one_sample_in_each_part():
    assert [len(p) for p in seeded_split(2, 0.01, 0)] == [1, 1]
    assert [len(p) for p in seeded_split(3, 0.99, 0)] == [1, 2]
    with pytest.raises(UserError, match="too small"):
        seeded_split(1, 0.2, 0)


# ---------------------------------------------------------------- digits


def test_digits_are_the_1797_sklearn_digits():
    splits = load("digits", val_fraction=0.25)
    train, val = splits.train, splits.val
    assert len(train) + len(val) == 1797 and len(val) == round(1797 * 0.25)
    assert train.x.dtype == torch.uint8 and train.x.shape[1:] == (1, 8, 8)
    everything = torch.cat([train.x, val.x])
    assert int(everything.min()) == 0 and int(everything.max()) == 16
    assert sorted(torch.cat([train.y, val.y]).unique().tolist()) == list(range(10))
    assert splits.spec.shape == (1, 8, 8) and splits.spec.num_classes == 10
    x = inputs(train)
    assert x.dtype == torch.float32
    assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05


def test_digits_split_follows_the_seed():
    a, b, c = load("digits", seed=1), load("digits", seed=1), load("digits", seed=2)
    assert torch.equal(a.val.x, b.val.x) and torch.equal(a.val.y, b.val.y)
    assert not torch.equal(a.val.x, c.val.x)


def test_digits_load_without_importing_sklearn(monkeypatch):
    for module in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
        monkeypatch.delitem(sys.modules, module)
    load("digits")
    assert "sklearn" not in sys.modules


def test_digits_fall_back_to_load_digits(monkeypatch):
    direct = digits.read_digits()
    monkeypatch.setattr(digits, "_csv_path", lambda: None)
    fallback = digits.read_digits()
    assert np.array_equal(direct[0], fallback[0]) and np.array_equal(direct[1], fallback[1])


# ---------------------------------------------------------------- mnist

MNIST_NAMES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "val_images": "t10k-images-idx3-ubyte",
    "val_labels": "t10k-labels-idx1-ubyte",
}


def idx_bytes(magic: int, array: np.ndarray) -> bytes:
    return struct.pack(f">I{array.ndim}I", magic, *array.shape) + array.astype(np.uint8).tobytes()


def write_file(path: Path, data: bytes, gz: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def write_mnist(folder: Path, gz: bool, n_train: int = 40, n_val: int = 12) -> dict[str, Path]:
    """MNIST-like IDX files (28 x 20 pixels, so rows and columns cannot be confused)."""
    rng = np.random.default_rng(0)
    paths = {}
    for split, n in (("train", n_train), ("val", n_val)):
        images = (rng.random((n, 28, 20)) < 0.1307) * 255  # mean 0.1307 after /255
        paths[f"{split}_images"] = write_file(
            folder / MNIST_NAMES[f"{split}_images"], idx_bytes(2051, images), gz
        )
        paths[f"{split}_labels"] = write_file(
            folder / MNIST_NAMES[f"{split}_labels"], idx_bytes(2049, np.arange(n) % 10), gz
        )
    return paths


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize("subdir", ["", "MNIST/raw"], ids=["flat", "torchvision"])
def test_mnist_loads_idx_files(tmp_path, gz, subdir):
    write_mnist(tmp_path / subdir, gz)
    splits = load("mnist", dir=tmp_path)
    assert splits.train.x.shape == (40, 1, 28, 20) and splits.train.x.dtype == torch.uint8
    assert splits.val.x.shape == (12, 1, 28, 20)
    assert splits.train.y.dtype == torch.int64
    assert splits.train.y.tolist() == [i % 10 for i in range(40)]
    assert splits.spec.shape == (1, 28, 20) and splits.spec.num_classes == 10
    assert abs(float(inputs(splits.train).mean())) < 0.05


def mnist_error(tmp_path: Path) -> pytest.ExceptionInfo:
    with pytest.raises(UserError) as err:
        load("mnist", dir=tmp_path)
    return err


def test_mnist_wrong_magic(tmp_path):
    paths = write_mnist(tmp_path, gz=False)
    labels = paths["train_labels"].read_bytes()
    paths["train_images"].write_bytes(labels)  # a label file under the image file's name
    err = mnist_error(tmp_path)
    assert_names(err, paths["train_images"])
    assert "2049" in str(err.value) and "2051" in str(err.value)


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_mnist_truncated_file(tmp_path, gz):
    paths = write_mnist(tmp_path, gz)
    path = paths["val_images"]
    raw = gzip.decompress(path.read_bytes()) if gz else path.read_bytes()
    write_file(tmp_path / MNIST_NAMES["val_images"], raw[:-100], gz)
    err = mnist_error(tmp_path)
    assert_names(err, path)
    assert "truncated" in str(err.value)


def test_mnist_header_only_partly_there(tmp_path):
    paths = write_mnist(tmp_path, gz=False)
    paths["train_labels"].write_bytes(b"\x00\x00\x08")
    assert_names(mnist_error(tmp_path), paths["train_labels"])


def test_mnist_count_mismatch(tmp_path):
    paths = write_mnist(tmp_path, gz=False)
    paths["train_labels"].write_bytes(idx_bytes(2049, np.zeros(39)))
    err = mnist_error(tmp_path)
    assert_names(err, paths["train_images"])
    assert_names(err, paths["train_labels"])


def test_mnist_missing_file(tmp_path):
    paths = write_mnist(tmp_path, gz=True)
    paths["val_labels"].unlink()
    with pytest.raises(UserError) as err:
        get_format("mnist").check(DataSection(name="mnist", dir=tmp_path))
    assert MNIST_NAMES["val_labels"] in str(err.value)


def test_mnist_corrupt_gzip(tmp_path):
    paths = write_mnist(tmp_path, gz=True)
    paths["train_images"].write_bytes(paths["train_images"].read_bytes()[:50])
    assert_names(mnist_error(tmp_path), paths["train_images"])


# ---------------------------------------------------------------- cifar10

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def write_cifar(folder: Path, per_batch: int = 20, n_test: int = 10) -> None:
    """The six pickled batches, data as N x 3072 planes of R, G, B."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = n_test if name == "test_batch" else per_batch
        images = pixels_around(rng, (n, 32, 32, 3), CIFAR_MEAN, CIFAR_STD)
        batch = {
            b"batch_label": name.encode(),
            b"data": images.transpose(0, 3, 1, 2).reshape(n, 3072),
            b"labels": [int(v) for v in rng.integers(0, 10, n)],
        }
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))


@pytest.mark.parametrize("subdir", ["", "cifar-10-batches-py"])
def test_cifar10_loads_pickled_batches(tmp_path, subdir):
    write_cifar(tmp_path / subdir)
    splits = load("cifar10", dir=tmp_path)
    assert splits.train.x.shape == (100, 3, 32, 32) and splits.train.x.dtype == torch.uint8
    assert splits.val.x.shape == (10, 3, 32, 32)
    folder = tmp_path / subdir
    first = pickle.loads((folder / "data_batch_1").read_bytes())
    assert splits.train.y[:20].tolist() == first[b"labels"]
    assert torch.equal(splits.train.x[0].reshape(-1), torch.from_numpy(first[b"data"][0]))
    assert splits.spec.shape == (3, 32, 32) and splits.spec.num_classes == 10
    channel_means = inputs(splits.train).mean(dim=(0, 2, 3))
    assert channel_means.abs().max() < 0.1


def cifar_error(tmp_path: Path) -> pytest.ExceptionInfo:
    with pytest.raises(UserError) as err:
        load("cifar10", dir=tmp_path)
    return err


def test_cifar10_missing_batch(tmp_path):
    write_cifar(tmp_path)
    (tmp_path / "data_batch_3").unlink()
    assert "data_batch_3" in str(cifar_error(tmp_path).value)


def test_cifar10_corrupt_pickle(tmp_path):
    write_cifar(tmp_path)
    (tmp_path / "data_batch_2").write_bytes(b"\x80\x02}q\x00(U\x04data")
    assert_names(cifar_error(tmp_path), tmp_path / "data_batch_2")


def test_cifar10_wrong_shape(tmp_path):
    write_cifar(tmp_path)
    batch = {b"data": np.zeros((5, 1024), np.uint8), b"labels": [0] * 5}
    (tmp_path / "test_batch").write_bytes(pickle.dumps(batch))
    err = cifar_error(tmp_path)
    assert_names(err, tmp_path / "test_batch")
    assert "3072" in str(err.value)


def test_cifar10_label_count_mismatch(tmp_path):
    write_cifar(tmp_path)
    batch = {b"data": np.zeros((5, 3072), np.uint8), b"labels": [0] * 4}
    (tmp_path / "data_batch_5").write_bytes(pickle.dumps(batch))
    assert_names(cifar_error(tmp_path), tmp_path / "data_batch_5")


class _Payload:
    """Unpickles into a call of os.mkdir: what a malicious 'batch' would do."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def test_cifar10_refuses_pickles_that_run_code(tmp_path):
    write_cifar(tmp_path)
    target = tmp_path / "pwned"
    (tmp_path / "data_batch_1").write_bytes(pickle.dumps({b"data": _Payload(str(target)), b"labels": []}))
    assert_names(cifar_error(tmp_path), tmp_path / "data_batch_1")
    assert not target.exists()


@pytest.mark.parametrize("numpy_module", [b"numpy._core", b"numpy.core"], ids=["numpy2", "numpy1"])
def test_cifar10_reads_pickles_of_either_numpy_without_warnings(tmp_path, recwarn, numpy_module):
    """The real batches name numpy.core (numpy 1), which numpy 2 only keeps as a deprecated alias."""
    write_cifar(tmp_path)
    path = tmp_path / "test_batch"
    path.write_bytes(path.read_bytes().replace(b"numpy._core", numpy_module))
    x, y = cifar10.read_batch(path)
    assert x.shape == (10, 3, 32, 32) and y.shape == (10,)
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


# ---------------------------------------------------------------- imagefolder


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch) -> Path:
    """Indexes go to a per-test cache directory, never to ~/.cache."""
    path = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("NODESCALE_CACHE_DIR", str(path))
    return path


def save_image(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def write_folder(
    root: Path, classes=("cat", "dog", "eel"), per_class: int = 4, size=(12, 10), seed=0
) -> None:
    """PNG class folders plus one JPEG per class in a nested directory; ``size`` is (width, height)."""
    rng = np.random.default_rng(seed)
    for name in classes:
        for i in range(per_class):
            save_image(
                root / name / f"{i:02d}.png",
                pixels_around(rng, (size[1], size[0], 3), IMAGENET_MEAN, IMAGENET_STD),
            )
        save_image(
            root / name / "more" / "x.jpg", pixels_around(rng, (size[1], size[0], 3), IMAGENET_MEAN, 0.1)
        )
        (root / name / "notes.txt").write_text("not an image")


def test_imagefolder_loads_class_folders(tmp_path):
    write_folder(tmp_path, per_class=6)
    splits = load("imagefolder", dir=tmp_path, val_fraction=0.25)
    assert splits.spec.shape == (3, 10, 12) and splits.spec.num_classes == 3
    assert len(splits.train) + len(splits.val) == 21
    x, y = splits.train[0]
    assert x.shape == (3, 10, 12) and x.dtype == torch.float32 and y.dtype == torch.int64
    everything = torch.cat([labels(splits.train), labels(splits.val)])
    assert sorted(everything.tolist()) == [0] * 7 + [1] * 7 + [2] * 7  # cat, dog, eel
    assert inputs(splits.train).mean(dim=(0, 2, 3)).abs().max() < 0.15


def test_imagefolder_label_is_the_sorted_class_index(tmp_path):
    write_folder(tmp_path, classes=("b", "a"), per_class=2)
    splits = load("imagefolder", dir=tmp_path)
    for dataset in (splits.train, splits.val):
        for i in range(len(dataset)):
            path = os.fsdecode(dataset.paths[i])
            assert int(dataset[i][1]) == (0 if path.startswith("a/") else 1)


def test_imagefolder_split_follows_the_seed(tmp_path):
    write_folder(tmp_path, per_class=6)
    a, b, c = (load("imagefolder", seed=s, dir=tmp_path) for s in (5, 5, 6))
    assert list(a.val.paths) == list(b.val.paths)
    assert list(a.val.paths) != list(c.val.paths)


def test_imagefolder_train_and_val_directories(tmp_path):
    write_folder(tmp_path / "train", per_class=3)
    write_folder(tmp_path / "val", classes=("cat", "eel"), per_class=1)
    splits = load("imagefolder", dir=tmp_path)
    assert len(splits.train) == 12 and len(splits.val) == 4
    assert splits.spec.num_classes == 3
    assert sorted(labels(splits.val).tolist()) == [0, 0, 2, 2]  # eel keeps its training index


def test_imagefolder_val_class_unknown_to_train(tmp_path):
    write_folder(tmp_path / "train", classes=("cat",), per_class=1)
    write_folder(tmp_path / "val", classes=("cow",), per_class=1)
    with pytest.raises(UserError) as err:
        load("imagefolder", dir=tmp_path)
    assert_names(err, tmp_path / "val" / "cow")


def test_imagefolder_resizes_to_image_size(tmp_path):
    write_folder(tmp_path, classes=("a",), per_class=2, size=(12, 10))
    write_folder(tmp_path, classes=("b",), per_class=2, size=(7, 20), seed=1)
    Image.fromarray(np.zeros((9, 9), np.uint8), mode="L").save(tmp_path / "b" / "grey.gif")
    splits = load("imagefolder", dir=tmp_path, image_size=8, val_fraction=0.3)
    assert splits.spec.shape == (3, 8, 8)
    assert {tuple(x.shape) for x in inputs(splits.train)} == {(3, 8, 8)}


def test_imagefolder_mixed_sizes_need_image_size(tmp_path):
    write_folder(tmp_path, classes=("a",), per_class=2, size=(12, 10))
    save_image(tmp_path / "b" / "wide.png", np.zeros((10, 30, 3), np.uint8))
    with pytest.raises(UserError) as err:
        load("imagefolder", dir=tmp_path)
    assert_names(err, tmp_path / "b" / "wide.png")
    assert "--set data.image_size=" in str(err.value)


def test_imagefolder_empty_class_directory(tmp_path):
    write_folder(tmp_path, classes=("a",), per_class=2)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("no images here")
    with pytest.raises(UserError) as err:
        load("imagefolder", dir=tmp_path)
    assert_names(err, tmp_path / "empty")


def test_imagefolder_without_class_directories(tmp_path):
    save_image(tmp_path / "loose.png", np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(UserError) as err:
        load("imagefolder", dir=tmp_path)
    assert_names(err, tmp_path)


def test_imagefolder_missing_directory(tmp_path):
    with pytest.raises(UserError) as err:
        get_format("imagefolder").check(DataSection(name="imagefolder", dir=tmp_path / "nope"))
    assert_names(err, tmp_path / "nope")


def test_imagefolder_prepare_writes_the_index_atomically(tmp_path, monkeypatch):
    write_folder(tmp_path, per_class=2)
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def spy(src, dst):
        renames.append((str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    cfg = DataSection(name="imagefolder", dir=tmp_path)
    get_format("imagefolder").prepare(cfg)
    path = imagefolder.index_path(tmp_path.resolve())
    assert renames == [(renames[0][0], str(path))]
    assert Path(renames[0][0]).parent == path.parent  # same directory: a rename, never a copy
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    index = json.loads(path.read_text())
    assert index["root"] == str(tmp_path.resolve()) and index["classes"] == ["cat", "dog", "eel"]
    assert index["train"]["cat"] == ["cat/00.png", "cat/01.png", "cat/more/x.jpg"]


def test_imagefolder_load_uses_a_fresh_index(tmp_path, monkeypatch):
    write_folder(tmp_path, per_class=2)
    cfg = DataSection(name="imagefolder", dir=tmp_path)
    fmt = get_format("imagefolder")
    fmt.prepare(cfg)
    real_scan = imagefolder.scan

    def no_scan(*args, **kwargs):
        raise AssertionError("load scanned the tree although a fresh index exists")

    monkeypatch.setattr(imagefolder, "scan", no_scan)
    fmt.prepare(cfg)  # idempotent: nothing to redo
    splits = fmt.load(cfg, seed=0)
    assert len(splits.train) + len(splits.val) == 9

    save_image(tmp_path / "dog" / "new.png", np.zeros((10, 12, 3), np.uint8))  # the index is now stale
    assert imagefolder.read_index(tmp_path.resolve()) is None
    monkeypatch.setattr(imagefolder, "scan", real_scan)
    splits = fmt.load(cfg, seed=0)
    assert len(splits.train) + len(splits.val) == 10


def test_imagefolder_index_is_keyed_by_path(tmp_path):
    write_folder(tmp_path / "one", classes=("a",), per_class=2)
    write_folder(tmp_path / "two", classes=("b",), per_class=2)
    fmt = get_format("imagefolder")
    for name in ("one", "two"):
        fmt.prepare(DataSection(name="imagefolder", dir=tmp_path / name))
    assert imagefolder.index_path((tmp_path / "one").resolve()) != imagefolder.index_path(
        (tmp_path / "two").resolve()
    )
    assert imagefolder.read_index((tmp_path / "two").resolve()).classes == ["b"]


def test_imagefolder_prepare_survives_an_unwritable_cache(tmp_path, monkeypatch):
    write_folder(tmp_path / "data", classes=("a",), per_class=2)
    (tmp_path / "file").write_text("a file where the cache directory should be")
    monkeypatch.setenv("NODESCALE_CACHE_DIR", str(tmp_path / "file"))
    splits = load("imagefolder", dir=tmp_path / "data")
    assert len(splits.train) + len(splits.val) == 3


# ---------------------------------------------------------------- hdf5


def hdf5_images(rng: np.random.Generator, n: int, layout: str) -> np.ndarray:
    """``n`` images of 3 x 8 x 6 (or 8 x 6 grey) pixels drawn around the ImageNet mean."""
    hwc = pixels_around(rng, (n, 8, 6, 3), IMAGENET_MEAN, IMAGENET_STD)
    if layout == "hwc":
        return hwc
    if layout == "chw_float":
        return hwc.transpose(0, 3, 1, 2).astype(np.float32) / 255
    if layout == "grey":
        return hwc[..., 0]
    raise ValueError(layout)


# name: (train images, train labels, val images, val labels or None), image layout
HDF5_LAYOUTS = {
    "groups": (("train/images", "train/labels", "val/images", "val/labels"), "hwc"),
    "groups-test": (("train/images", "train/labels", "test/images", "test/labels"), "chw_float"),
    "flat": (("train_images", "train_labels", "val_images", "val_labels"), "hwc"),
    "keras": (("x_train", "y_train", "x_test", "y_test"), "grey"),
    "lumi-tiny-imagenet": (("images", "labels", None, None), "chw_float"),
}


def write_hdf5(path: Path, keys, layout: str, n_train: int = 30, n_val: int = 10) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    train_images, train_labels, val_images, val_labels = keys
    arrays = {
        train_images: hdf5_images(rng, n_train, layout),
        train_labels: (np.arange(n_train) % 5).astype(np.int32),
    }
    if val_images is not None:
        arrays[val_images] = hdf5_images(rng, n_val, layout)
        arrays[val_labels] = (np.arange(n_val) % 5).astype(np.int64)
    with h5py.File(path, "w") as file:
        for key, array in arrays.items():
            file[key] = array
    return arrays


@pytest.mark.parametrize("name", list(HDF5_LAYOUTS))
def test_hdf5_layouts(tmp_path, name):
    keys, layout = HDF5_LAYOUTS[name]
    arrays = write_hdf5(tmp_path / "data.h5", keys, layout)
    splits = load("hdf5", dir=tmp_path / "data.h5", val_fraction=0.2)
    channels = 1 if layout == "grey" else 3
    assert splits.spec.shape == (channels, 8, 6) and splits.spec.num_classes == 5
    x, y = splits.train[0]
    assert x.shape == (channels, 8, 6) and x.dtype == torch.float32 and y.dtype == torch.int64
    if keys[2] is None:  # one set, split by the seed
        assert (len(splits.train), len(splits.val)) == (24, 6)
        rows = np.concatenate([splits.train.rows, splits.val.rows])
        assert sorted(rows.tolist()) == list(range(30))
        assert labels(splits.val).tolist() == (splits.val.rows % 5).tolist()
    else:
        assert (len(splits.train), len(splits.val)) == (30, 10)
        assert labels(splits.train).tolist() == arrays[keys[1]].tolist()
    if channels == 3:
        assert inputs(splits.train).mean(dim=(0, 2, 3)).abs().max() < 0.15


def test_hdf5_pixels_match_the_file(tmp_path):
    keys, _ = HDF5_LAYOUTS["groups"]
    arrays = write_hdf5(tmp_path / "data.h5", keys, "hwc")
    splits = load("hdf5", dir=tmp_path / "data.h5")
    expected = torch.from_numpy(arrays["val/images"][3]).permute(2, 0, 1).float() / 255
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    assert torch.allclose(splits.val[3][0], ((expected - mean) / std).float(), atol=1e-5)


def test_hdf5_split_follows_the_seed(tmp_path):
    keys, layout = HDF5_LAYOUTS["lumi-tiny-imagenet"]
    write_hdf5(tmp_path / "tiny.hdf5", keys, layout)
    a, b, c = (load("hdf5", seed=s, dir=tmp_path / "tiny.hdf5") for s in (1, 1, 2))
    assert a.val.rows.tolist() == b.val.rows.tolist()
    assert a.val.rows.tolist() != c.val.rows.tolist()


def test_hdf5_directory_with_one_file(tmp_path):
    keys, layout = HDF5_LAYOUTS["flat"]
    write_hdf5(tmp_path / "only.hdf5", keys, layout)
    assert len(load("hdf5", dir=tmp_path).train) == 30


def test_hdf5_reads_in_dataloader_workers(tmp_path):
    keys, layout = HDF5_LAYOUTS["groups"]
    write_hdf5(tmp_path / "data.h5", keys, layout)
    train = load("hdf5", dir=tmp_path / "data.h5").train
    direct = [train[i][0] for i in range(8)]  # opens the file in this process before workers fork
    loader = DataLoader(train, batch_size=4, num_workers=2)
    batches = [x for x, _ in loader]
    assert torch.equal(torch.cat(batches)[:8], torch.stack(direct))
    clone = pickle.loads(pickle.dumps(train))
    assert torch.equal(clone[5][0], direct[5])


def hdf5_error(path: Path) -> pytest.ExceptionInfo:
    with pytest.raises(UserError) as err:
        load("hdf5", dir=path)
    return err


def test_hdf5_missing_file(tmp_path):
    assert_names(hdf5_error(tmp_path / "nope.h5"), tmp_path / "nope.h5")


def test_hdf5_not_an_hdf5_file(tmp_path):
    (tmp_path / "fake.h5").write_text("images,labels\n")
    assert_names(hdf5_error(tmp_path / "fake.h5"), tmp_path / "fake.h5")


def test_hdf5_directory_with_several_files(tmp_path):
    for name in ("a.h5", "b.h5"):
        write_hdf5(tmp_path / name, *HDF5_LAYOUTS["flat"])
    err = hdf5_error(tmp_path)
    assert_names(err, tmp_path)
    assert "a.h5" in str(err.value) and "b.h5" in str(err.value)


def test_hdf5_missing_keys_lists_what_is_there(tmp_path):
    with h5py.File(tmp_path / "odd.h5", "w") as file:
        file["pictures"] = np.zeros((4, 8, 8, 3), np.uint8)
        file["meta/classes"] = np.arange(4)
    err = hdf5_error(tmp_path / "odd.h5")
    assert_names(err, tmp_path / "odd.h5")
    assert "pictures" in str(err.value) and "meta/classes" in str(err.value)


def test_hdf5_length_mismatch(tmp_path):
    with h5py.File(tmp_path / "bad.h5", "w") as file:
        file["train/images"] = np.zeros((6, 8, 8, 3), np.uint8)
        file["train/labels"] = np.zeros(5, np.int64)
    err = hdf5_error(tmp_path / "bad.h5")
    assert_names(err, tmp_path / "bad.h5")
    assert "6 images" in str(err.value) and "5 labels" in str(err.value)


def test_hdf5_float_labels_are_refused(tmp_path):
    with h5py.File(tmp_path / "bad.h5", "w") as file:
        file["images"] = np.zeros((6, 8, 8, 3), np.uint8)
        file["labels"] = np.zeros(6, np.float32)
    assert_names(hdf5_error(tmp_path / "bad.h5"), tmp_path / "bad.h5")


def test_hdf5_check_rejects_what_load_would(tmp_path):
    (tmp_path / "fake.h5").write_text("not hdf5")
    with pytest.raises(UserError):
        get_format("hdf5").check(DataSection(name="hdf5", dir=tmp_path / "fake.h5"))


# ---------------------------------------------------------------- synthetic, regression


def test_synthetic_images(tmp_path):
    splits = load("synthetic", seed=3, samples=64, image_size=12, channels=2, num_classes=7)
    assert splits.spec.shape == (2, 12, 12) and splits.spec.num_classes == 7
    assert isinstance(splits.train, ArrayDataset) and splits.train.x.dtype == torch.float32
    assert splits.train.x.shape == (64, 2, 12, 12) and len(splits.val) == 8
    assert 0 <= int(splits.train.y.min()) and int(splits.train.y.max()) < 7
    again, other = load("synthetic", seed=3, samples=64), load("synthetic", seed=4, samples=64)
    assert again.train.x.shape == (64, 3, 32, 32)
    assert torch.equal(load("synthetic", seed=3, samples=64).train.x, again.train.x)
    assert not torch.equal(other.train.x, again.train.x)
    assert len(load("synthetic", samples=3).val) == 1


def test_regression_is_learnable():
    splits = load("regression", seed=2, samples=500)
    train, val = splits.train, splits.val
    assert splits.spec.shape == (20,) and splits.spec.num_classes == 1 and splits.spec.task == "regression"
    assert train.x.shape == (500, 20) and train.y.shape == (500, 1) and len(val) == 100
    assert train.x.dtype == train.y.dtype == torch.float32
    design = torch.cat([train.x, torch.ones(500, 1)], dim=1)
    fit = torch.linalg.lstsq(design, train.y).solution
    residual = val.y - torch.cat([val.x, torch.ones(100, 1)], dim=1) @ fit
    assert 0.07 < float(residual.std()) < 0.13  # the noise floor, 0.1
    assert torch.equal(load("regression", seed=2, samples=500).train.y, train.y)
    assert not torch.equal(load("regression", seed=3, samples=500).train.y, train.y)


# ---------------------------------------------------------------- checks without torch

# Run in a fresh interpreter: checks every case in order, noting whether torch got imported by each,
# then one failing check, whose message it prints.
CHECK_WITHOUT_TORCH = """
import json, sys
from nodescale.config.schema import DataSection
from nodescale.data.registry import get_format
from nodescale.errors import UserError

cases, failing = json.loads(sys.argv[1]), json.loads(sys.argv[2])
imported_torch = {}
for name, fields in cases:
    get_format(name).check(DataSection(name=name, **fields))
    imported_torch[name] = "torch" in sys.modules
try:
    get_format(failing[0]).check(DataSection(name=failing[0], **failing[1]))
    error = None
except UserError as err:
    error = str(err)
print(json.dumps({"imported_torch": imported_torch, "error": error, "torch": "torch" in sys.modules}))
"""


def write_word_tokenizer(path: Path) -> Path:
    """A three-word tokenizer.json whose </s> ends documents."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"</s>": 0, "a": 1, "b": 2}, unk_token="</s>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


def test_checks_do_not_import_torch(tmp_path):
    """The launcher checks every format before starting workers; torch would cost it 1.5 s."""
    write_mnist(tmp_path / "mnist", gz=True)
    write_cifar(tmp_path / "cifar", per_batch=2, n_test=2)
    write_folder(tmp_path / "images", per_class=1)
    keys, layout = HDF5_LAYOUTS["groups"]
    write_hdf5(tmp_path / "data.h5", keys, layout, n_train=4, n_val=2)
    (tmp_path / "empty").mkdir()
    import datasets  # not at the top: 1.2 s to import

    tokenizer = str(write_word_tokenizer(tmp_path / "tokenizer.json"))
    (tmp_path / "c.txt").write_text("a b\n\nb a\n")
    (tmp_path / "c.jsonl").write_text('{"text": "a b"}\n')
    datasets.Dataset.from_dict({"text": ["a b", "b a"]}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "tokens").mkdir()
    for name in ("train.bin", "val.bin"):
        np.arange(300, dtype=np.uint16).tofile(tmp_path / "tokens" / name)
    import zarr  # not at the top: only this case needs it

    store = zarr.open_group(tmp_path / "grid.zarr", mode="w")
    for name in ("a", "b"):
        store.create_array(name, shape=(4, 2), chunks=(2, 2), dtype="f4", dimension_names=("t", "x"))
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "train-000000.tar", "w") as tar:
        tar.add(next((tmp_path / "images").rglob("*.png")), "k.png")
    cases = [
        ("digits", {}),
        ("mnist", {"dir": str(tmp_path / "mnist")}),
        ("cifar10", {"dir": str(tmp_path / "cifar")}),
        ("imagefolder", {"dir": str(tmp_path / "images")}),
        ("hdf5", {"dir": str(tmp_path / "data.h5")}),
        ("synthetic", {"samples": 8}),
        ("regression", {"samples": 8}),
        ("text", {"dir": str(tmp_path / "c.txt"), "tokenizer": tokenizer}),
        ("jsonl", {"dir": str(tmp_path / "c.jsonl"), "tokenizer": tokenizer}),
        ("hf_dataset", {"dir": str(tmp_path / "saved"), "tokenizer": tokenizer}),
        ("pydoc", {}),
        ("tokens", {"dir": str(tmp_path / "tokens"), "seq_len": 8}),
        ("zarr", {"dir": str(tmp_path / "grid.zarr"), "inputs": ["a"], "targets": ["b"], "window": {"t": 2}}),
        ("shards", {"dir": str(tmp_path / "shards")}),
    ]
    assert {name for name, _ in cases} == set(DATASETS), "every registered format needs a case here"
    failing = ("mnist", {"dir": str(tmp_path / "empty")})
    with pytest.raises(UserError) as expected:
        get_format(failing[0]).check(DataSection(name=failing[0], **failing[1]))

    src = str(Path(nodescale.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-c", CHECK_WITHOUT_TORCH, json.dumps(cases), json.dumps(failing)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    first = next((name for name, imported in report["imported_torch"].items() if imported), None)
    assert first is None, f"checking {first!r} imported torch"
    assert list(report["imported_torch"]) == [name for name, _ in cases]
    assert report["error"] == str(expected.value)
    assert not report["torch"], "the failing check imported torch"
