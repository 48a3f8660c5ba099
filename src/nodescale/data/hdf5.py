"""Images and integer labels in an HDF5 file, read one sample at a time.

Layouts understood, tried in this order:

* groups ``train/`` and ``val/`` (or ``valid/``, ``validation/``, ``test/``),
  each with ``images`` and ``labels`` datasets;
* flat keys ``train_images``/``train_labels`` with ``val_``, ``valid_``,
  ``validation_`` or ``test_`` likewise, or Keras-style ``x_train``/``y_train``
  with ``x_val``/``x_test``;
* top-level ``images`` and ``labels`` only, as in the Tiny-ImageNet file of the
  LUMI AI guide (float32 N x 3 x 64 x 64 in 0..1): split with the run's seed,
  as is a training set found without a validation set.

Images are N x H x W x C (when C, the last dimension, is 1 or 3),
N x C x H x W, or N x H x W; uint8 (divided by 255) or float (taken as already
in 0..1). Labels are integers, N or N x 1.

Samples are read by ``HDF5Dataset`` (``nodescale.data.hdf5_dataset``), which
``load`` imports: this module stays free of torch for the launcher's ``check``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from nodescale.data.base import DatasetSplits
from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    import torch

    from nodescale.data.section import DataSection

SUFFIXES = (".h5", ".hdf5")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_VAL_NAMES = ("val", "valid", "validation", "test")
TRAIN_KEYS = (("train/images", "train/labels"), ("train_images", "train_labels"), ("x_train", "y_train"))
VAL_KEYS = (
    *((f"{name}/images", f"{name}/labels") for name in _VAL_NAMES),
    *((f"{name}_images", f"{name}_labels") for name in _VAL_NAMES),
    ("x_val", "y_val"),
    ("x_test", "y_test"),
)
WHOLE_KEYS = ("images", "labels")


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as err:
        raise UserError("dataset 'hdf5'", "needs h5py", "pip install 'nodescale[hdf5]'") from err
    return h5py


def open_file(path: Path | str) -> Any:
    """``path`` opened read-only, without HDF5's file locking where the library allows.

    Locking fails on parallel filesystems mounted without flock support, and a
    reader needs none.
    """
    h5py = _h5py()
    try:
        return h5py.File(path, "r", locking=False)
    except (TypeError, ValueError):  # h5py or HDF5 too old for the locking argument
        return h5py.File(path, "r")


def locate(cfg: DataSection) -> Path:
    """The HDF5 file: ``cfg.dir`` itself, or the one .h5/.hdf5 file in that directory."""
    if cfg.dir is None:
        raise UserError("dataset 'hdf5'", "needs the location of its file", "pass --data-dir FILE.h5")
    path = Path(cfg.dir).expanduser()
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix.lower() in SUFFIXES and p.is_file())
        if len(found) != 1:
            names = ", ".join(p.name for p in found) if found else "none"
            raise UserError(
                f"data directory {path}",
                f"must hold exactly one HDF5 file ({'/'.join(SUFFIXES)}); found {names}",
                "pass --data-dir FILE.h5 to choose the file",
            )
        path = found[0]
    if not path.is_file():
        raise UserError(f"HDF5 file {path}", "does not exist", "pass --data-dir FILE.h5 (or its directory)")
    if not _h5py().is_hdf5(path):
        raise UserError(f"{path}", "is not an HDF5 file", "pass the .h5 file holding images and labels")
    return path


@dataclass(frozen=True)
class ImageLayout:
    """How one images dataset stores its samples, and the shape it yields."""

    shape: tuple[int, int, int]  # (C, H, W)
    hwc: bool
    scale: float


@dataclass
class Part:
    """The images key, layout and in-memory labels of one set in the file."""

    images_key: str
    layout: ImageLayout
    labels: torch.Tensor


def _has(file: Any, key: str) -> bool:
    return key in file and isinstance(file[key], _h5py().Dataset)


def _contents(file: Any) -> str:
    """The datasets in ``file`` with shapes and types, for error messages."""
    found: list[str] = []

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, _h5py().Dataset):
            found.append(f"{name} {obj.shape} {obj.dtype}")

    file.visititems(visit)
    shown = ", ".join(found[:20]) + (f" and {len(found) - 20} more" if len(found) > 20 else "")
    return shown or "no datasets"


def find_keys(file: Any, path: Path) -> tuple[tuple[str, str], tuple[str, str] | None]:
    """(images, labels) keys of the training set and of the validation set, if the file has one."""
    train = next((keys for keys in TRAIN_KEYS if all(_has(file, k) for k in keys)), None)
    if train is not None:
        val = next((keys for keys in VAL_KEYS if all(_has(file, k) for k in keys)), None)
        return train, val
    if all(_has(file, k) for k in WHOLE_KEYS):
        return WHOLE_KEYS, None
    raise UserError(
        f"{path}",
        f"has no images and labels nodescale knows; it holds {_contents(file)}",
        "use train/images + train/labels (and val/...), train_images + train_labels, or images + labels",
    )


def _image_layout(dataset: Any, path: Path) -> ImageLayout:
    shape = tuple(dataset.shape)
    where = f"{path}:{dataset.name}"
    if len(shape) == 3:
        chw, hwc = (1, shape[1], shape[2]), False
    elif len(shape) == 4 and shape[-1] in (1, 3):
        chw, hwc = (shape[3], shape[1], shape[2]), True
    elif len(shape) == 4:
        chw, hwc = (shape[1], shape[2], shape[3]), False
    else:
        raise UserError(where, f"has shape {shape}, expected N x H x W x C, N x C x H x W or N x H x W")
    if dataset.dtype == np.uint8:
        scale = 255.0
    elif np.issubdtype(dataset.dtype, np.floating):
        scale = 1.0
    else:
        raise UserError(where, f"holds {dataset.dtype} images, expected uint8 (0..255) or float (0..1)")
    return ImageLayout(chw, hwc, scale)


def _read_part(file: Any, keys: tuple[str, str], path: Path) -> Part:
    import torch  # not at the top: see nodescale.data.base

    images_key, labels_key = keys
    images = file[images_key]
    layout = _image_layout(images, path)
    labels = np.asarray(file[labels_key][()])
    where = f"{path}:{file[labels_key].name}"
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise UserError(where, f"holds {labels.dtype} labels of shape {labels.shape}, expected N integers")
    if len(labels) == 0:
        raise UserError(where, "holds no labels; the set is empty", "write the samples into the file")
    if len(labels) != len(images):
        raise UserError(
            f"{path}",
            f"has {len(images)} images in {images.name} but {len(labels)} labels in {file[labels_key].name}",
            "every image needs exactly one label",
        )
    if labels.min() < 0:
        raise UserError(where, f"holds a negative label ({labels.min()}), expected classes 0..K-1")
    return Part(images_key, layout, torch.from_numpy(labels.astype(np.int64)))


class HDF5Format:
    """Images and labels in one HDF5 file."""

    name = "hdf5"
    needs_dir = True

    def check(self, cfg: DataSection) -> None:
        """The file exists and is HDF5."""
        locate(cfg)

    def prepare(self, cfg: DataSection) -> None:
        """Nothing to prepare: samples are read from the file as needed."""

    def load(self, cfg: DataSection, seed: int) -> DatasetSplits:
        """Both sets, the validation one from the file or split off with ``seed``."""
        import torch  # not at the top: see nodescale.data.base

        from nodescale.data.hdf5_dataset import HDF5Dataset
        from nodescale.data.split import seeded_split

        path = locate(cfg)
        try:
            file = open_file(path)
        except OSError as err:
            raise UserError(
                f"{path}", f"cannot be opened as HDF5 ({err})", "check the file is complete"
            ) from err
        with file:  # only to find the layout and read labels; samples are read lazily
            train_keys, val_keys = find_keys(file, path)
            train = _read_part(file, train_keys, path)
            val = None if val_keys is None else _read_part(file, val_keys, path)
        if val is None:
            train_rows, val_rows = seeded_split(len(train.labels), cfg.val_fraction, seed)
            train_set = HDF5Dataset(path, train, train_rows)
            val_set = HDF5Dataset(path, train, val_rows)
            labels = train.labels
        else:
            if val.layout.shape != train.layout.shape:
                raise UserError(
                    f"{path}",
                    f"has validation images of shape {val.layout.shape} (C, H, W)"
                    f" but training images of {train.layout.shape}",
                    "both sets must hold images of one size",
                )
            train_set, val_set = HDF5Dataset(path, train), HDF5Dataset(path, val)
            labels = torch.cat([train.labels, val.labels])
        return DatasetSplits(train_set, val_set, InputSpec(train.layout.shape, int(labels.max()) + 1))


FORMAT = HDF5Format()
