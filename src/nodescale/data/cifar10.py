"""CIFAR-10 from its "python version" pickle batches.

``data_batch_1`` .. ``data_batch_5`` form the training set and ``test_batch``
the validation set, each a pickled dict with ``data`` (uint8, N x 3072, the
red, green and blue planes of 32x32 images) and ``labels`` (N ints). They may
sit in the given directory or in its ``cifar-10-batches-py/`` sub-directory,
as the archive unpacks.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from nodescale.data.base import DatasetSplits
from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    import torch

    from nodescale.data.section import DataSection

SCALE = 255.0
# Per-channel mean and std of the 50,000 training images (pixels divided by 255).
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
NUM_CLASSES = 10
SIDE = 32

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
VAL_FILE = "test_batch"
SUBDIR = "cifar-10-batches-py"

# The only globals a CIFAR batch refers to: numpy's array (and scalar)
# reconstructors, and _codecs.encode, which protocol-2 pickles written by
# Python 3 use for raw bytes. Anything else would run arbitrary code from a
# file that may sit in a shared project directory, so it is refused.
_ALLOWED = {
    ("_codecs", "encode"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("numpy._core"):  # pickles written by numpy 2
            module = module.replace("numpy._core", "numpy.core", 1)
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which a CIFAR-10 batch never does")
        if module.startswith("numpy.core") and hasattr(np, "_core"):
            module = module.replace("numpy.core", "numpy._core", 1)  # numpy 2 deprecates numpy.core
        return super().find_class(module, name)


def locate(root: Path) -> Path:
    """The directory holding all six batch files: ``root`` or its ``cifar-10-batches-py``."""
    if not root.is_dir():
        raise UserError(
            f"data directory {root}",
            "does not exist or is not a directory",
            f"pass --data-dir DIR holding {SUBDIR}",
        )
    names = (*TRAIN_FILES, VAL_FILE)
    for folder in (root, root / SUBDIR):
        if all((folder / name).is_file() for name in names):
            return folder
    folder = root / SUBDIR if (root / SUBDIR).is_dir() else root
    missing = [name for name in names if not (folder / name).is_file()]
    raise UserError(
        f"data directory {folder}",
        f"lacks the CIFAR-10 batch file{'s' if len(missing) > 1 else ''} {', '.join(missing)}",
        "point --data-dir at the unpacked cifar-10-python.tar.gz (the python version, not the binary one)",
    )


def read_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(N, 3, 32, 32)`` uint8 and labels ``(N,)`` int64 from one batch file."""
    import torch  # not at the top: see nodescale.data.base

    try:
        with path.open("rb") as file:
            batch = _ArrayUnpickler(file, encoding="bytes").load()
    except Exception as err:  # a corrupt pickle can fail in any of a dozen ways; all mean the same
        raise UserError(
            f"{path}", f"is not a readable CIFAR-10 batch ({err})", "download the dataset again"
        ) from err
    if not isinstance(batch, dict):
        raise UserError(f"{path}", f"holds a {type(batch).__name__}, expected a dict with data and labels")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        keys = ", ".join(repr(k) for k in batch)
        raise UserError(f"{path}", f"lacks b'data' or b'labels' (it has {keys})", "is this a CIFAR-10 batch?")
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3 * SIDE**2
    ):
        found = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise UserError(f"{path}", f"has data of {found}, expected uint8 N x {3 * SIDE**2}")
    try:
        y = torch.as_tensor(np.asarray(labels, dtype=np.int64))
    except (TypeError, ValueError) as err:
        raise UserError(f"{path}", f"has labels that are not integers ({err})") from err
    if y.shape != (len(data),):
        raise UserError(f"{path}", f"has {len(data)} images but labels of shape {tuple(y.shape)}")
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= NUM_CLASSES):
        raise UserError(
            f"{path}", f"has labels from {int(y.min())} to {int(y.max())}, expected 0..{NUM_CLASSES - 1}"
        )
    x = torch.from_numpy(np.ascontiguousarray(data)).view(-1, 3, SIDE, SIDE)
    return x, y


class Cifar10Format:
    """CIFAR-10 in memory as ``(N, 3, 32, 32)`` uint8."""

    name = "cifar10"
    needs_dir = True

    def check(self, cfg: DataSection) -> None:
        """All six batch files are present."""
        locate(_root(cfg))

    def prepare(self, cfg: DataSection) -> None:
        """Nothing to prepare: the batches are read whole."""

    def load(self, cfg: DataSection, seed: int) -> DatasetSplits:
        """Training set from the five data batches, validation set from the test batch."""
        import torch  # not at the top: see nodescale.data.base

        from nodescale.data.arrays import ArrayDataset

        folder = locate(_root(cfg))
        parts = [read_batch(folder / name) for name in TRAIN_FILES]
        train_x = torch.cat([x for x, _ in parts])
        train_y = torch.cat([y for _, y in parts])
        val_x, val_y = read_batch(folder / VAL_FILE)
        return DatasetSplits(
            train=ArrayDataset(train_x, train_y, scale=SCALE, mean=MEAN, std=STD),
            val=ArrayDataset(val_x, val_y, scale=SCALE, mean=MEAN, std=STD),
            spec=InputSpec((3, SIDE, SIDE), NUM_CLASSES),
        )


def _root(cfg: DataSection) -> Path:
    if cfg.dir is None:
        raise UserError("dataset 'cifar10'", "needs the location of its files", "pass --data-dir DIR")
    return Path(cfg.dir).expanduser()


FORMAT = Cifar10Format()
