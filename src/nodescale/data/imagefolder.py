"""Images in one sub-directory per class, decoded per item in DataLoader workers.

Either ``DIR/<class>/...`` (split into training and validation with the run's
seed) or ``DIR/train/<class>/...`` and ``DIR/val/<class>/...``. Classes are the
sorted sub-directory names; images may sit at any depth under their class.

Listing a large tree (ImageNet: 1.3 M files) from every rank hammers the
metadata server of a parallel filesystem, so ``prepare`` - one process per
node - lists it once and writes an index into a cache directory (the data
directory itself is often read-only). ``load`` uses the index while every
directory it lists still has the modification time recorded in it. Images are
decoded by ``ImageFolderDataset`` (``nodescale.data.imagefolder_dataset``),
which ``load`` imports: this module stays free of torch for the launcher's ``check``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from nodescale.data.base import DatasetSplits
from nodescale.data.cache_location import CACHE_ENV, cache_dir
from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from nodescale.data.section import DataSection

log = logging.getLogger(__name__)

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".gif", ".webp")
MEAN = (0.485, 0.456, 0.406)  # ImageNet
STD = (0.229, 0.224, 0.225)
INDEX_VERSION = 1


@dataclass
class FolderIndex:
    """What a scan of an image tree found.

    ``train`` and ``val`` map each class name to its images, as paths relative
    to ``root``; ``val`` is None when the tree has no ``train/``+``val/`` split.
    ``dirs`` holds the modification time (ns) of every directory listed, to
    tell when the index is stale. ``size`` is the (width, height) shared by all
    images, or None where sizes were not checked.
    """

    root: str
    classes: list[str]
    train: dict[str, list[str]]
    val: dict[str, list[str]] | None
    dirs: dict[str, int]
    size: tuple[int, int] | None

    def to_json(self) -> dict[str, Any]:
        return {"version": INDEX_VERSION, **self.__dict__}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FolderIndex:
        size = data["size"]
        return cls(
            root=data["root"],
            classes=list(data["classes"]),
            train=dict(data["train"]),
            val=None if data["val"] is None else dict(data["val"]),
            dirs={str(k): int(v) for k, v in data["dirs"].items()},
            size=None if size is None else (int(size[0]), int(size[1])),
        )

    def is_fresh(self) -> bool:
        """Every directory listed still exists with the same modification time."""
        try:
            return all(
                os.stat(os.path.join(self.root, rel)).st_mtime_ns == mtime for rel, mtime in self.dirs.items()
            )
        except OSError:
            return False


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as err:
        raise UserError(
            "dataset 'imagefolder'", "needs Pillow to decode images", "pip install 'nodescale[images]'"
        ) from err
    return Image


def _join(rel: str, name: str) -> str:
    """``rel/name`` with "/" on every system, ``name`` alone under the root."""
    return name if rel == "." else f"{rel}/{name}"


def _list_images(root: str, rel: str, dirs: dict[str, int]) -> list[str]:
    """Images at any depth under ``root/rel``, sorted, as paths relative to ``root``.

    Records the modification time of every directory it lists in ``dirs``.
    """
    folder = os.path.join(root, rel)
    # The mtime is taken before listing: a file added meanwhile makes the index stale, never silently missing.
    dirs[rel] = os.stat(folder).st_mtime_ns
    files: list[str] = []
    subdirs: list[str] = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                subdirs.append(_join(rel, entry.name))
            elif entry.name.lower().endswith(EXTENSIONS):
                files.append(_join(rel, entry.name))
    files.sort()
    for sub in sorted(subdirs):
        files.extend(_list_images(root, sub, dirs))
    return files


def _scan_classes(root: str, rel: str, dirs: dict[str, int]) -> dict[str, list[str]]:
    """Class name -> images, for the class directories directly under ``root/rel``."""
    top = os.path.join(root, rel)
    dirs[rel] = os.stat(top).st_mtime_ns
    with os.scandir(top) as entries:
        names = sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))
    if not names:
        raise UserError(
            f"image directory {os.path.normpath(top)}",
            "has no class sub-directories",
            "put the images of each class in their own sub-directory: DIR/<class>/<image>",
        )
    classes: dict[str, list[str]] = {}
    for name in names:
        files = _list_images(root, _join(rel, name), dirs)
        if not files:
            raise UserError(
                f"class directory {os.path.join(root, _join(rel, name))}",
                f"holds no images ({', '.join(e.lstrip('.') for e in EXTENSIONS)})",
                "remove the directory or add its images",
            )
        classes[name] = files
    return classes


def _common_size(root: str, groups: list[dict[str, list[str]]]) -> tuple[int, int]:
    """The (width, height) every image shares, reading only the image headers."""
    image = _pil()
    first: tuple[str, tuple[int, int]] | None = None
    for group in groups:
        for files in group.values():
            for rel in files:
                path = os.path.join(root, rel)
                try:
                    with image.open(path) as img:  # lazy: reads the header, not the pixels
                        size = img.size
                except OSError as err:
                    raise UserError(
                        f"{path}", f"is not a readable image ({err})", "remove or replace it"
                    ) from err
                if first is None:
                    first = (path, size)
                elif size != first[1]:
                    raise UserError(
                        f"{path}",
                        f"is {size[0]}x{size[1]} pixels but {first[0]} is {first[1][0]}x{first[1][1]};"
                        " without data.image_size all images must share one size",
                        "resize them on loading with --set data.image_size=N (e.g. 224)",
                    )
    assert first is not None  # _scan_classes refuses empty classes
    return first[1]


def scan(root: Path, check_size: bool) -> FolderIndex:
    """List the image tree at ``root`` (absolute); with ``check_size``, also check all share one size."""
    top = str(root)
    dirs: dict[str, int] = {}
    val: dict[str, list[str]] | None = None
    if (root / "train").is_dir() and (root / "val").is_dir():
        dirs["."] = os.stat(top).st_mtime_ns
        train = _scan_classes(top, "train", dirs)
        val = _scan_classes(top, "val", dirs)
        unknown = sorted(set(val) - set(train))
        if unknown:
            raise UserError(
                f"validation class directory {root / 'val' / unknown[0]}",
                "has no counterpart under train/",
                "val/ must use the class names of train/",
            )
    else:
        train = _scan_classes(top, ".", dirs)
    size = _common_size(top, [train] if val is None else [train, val]) if check_size else None
    return FolderIndex(top, sorted(train), train, val, dirs, size)


def index_path(root: Path) -> Path:
    """The index file of the tree at ``root`` (absolute), named by a hash of the path."""
    key = hashlib.sha256(str(root).encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return cache_dir() / "imagefolder" / f"{key}.json"


def write_index(index: FolderIndex, path: Path) -> None:
    """Write ``index`` to ``path`` atomically: ranks reading it see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary file sits in the same directory so os.replace is a rename within one filesystem.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            json.dump(index.to_json(), file, separators=(",", ":"))
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_index(root: Path) -> FolderIndex | None:
    """The cached index of ``root`` (absolute) if there is one, for this path, and fresh."""
    path = index_path(root)
    try:
        with path.open(encoding="utf-8") as file:
            data = json.load(file)
        if data.get("version") != INDEX_VERSION:
            return None
        index = FolderIndex.from_json(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None  # missing or damaged: scan instead
    if index.root != str(root) or not index.is_fresh():
        return None
    return index


def _samples(index: FolderIndex, group: dict[str, list[str]]) -> tuple[np.ndarray, np.ndarray]:
    label_of = {name: i for i, name in enumerate(index.classes)}
    paths = [os.fsencode(rel) for name in sorted(group) for rel in group[name]]
    labels = [label_of[name] for name in sorted(group) for _ in group[name]]
    return np.array(paths, dtype=np.bytes_), np.array(labels, dtype=np.int64)


class ImageFolderFormat:
    """Class-per-directory images with a cached file index."""

    name = "imagefolder"
    needs_dir = True

    def check(self, cfg: DataSection) -> None:
        """The directory exists and Pillow is installed."""
        _root(cfg)
        _pil()

    def prepare(self, cfg: DataSection) -> None:
        """Scan the tree and cache its index, unless a fresh index is already there."""
        root = _root(cfg)
        index = read_index(root)
        if index is not None and (index.size is not None or cfg.image_size is not None):
            return
        index = scan(root, check_size=cfg.image_size is None)
        try:
            write_index(index, index_path(root))
        except OSError as err:  # a read-only home must not stop training; every rank then scans
            log.warning("could not cache the image index in %s (%s); set %s", cache_dir(), err, CACHE_ENV)

    def load(self, cfg: DataSection, seed: int) -> DatasetSplits:
        """Both splits, from the cached index when it is fresh, else from a scan."""
        from nodescale.data.imagefolder_dataset import ImageFolderDataset  # not at the top: see nodescale.data.base
        from nodescale.data.split import seeded_split

        root = _root(cfg)
        index = read_index(root)
        if index is None or (index.size is None and cfg.image_size is None):
            index = scan(root, check_size=cfg.image_size is None)
        paths, labels = _samples(index, index.train)
        if index.val is not None:
            val_paths, val_labels = _samples(index, index.val)
        else:
            train, val = seeded_split(len(paths), cfg.val_fraction, seed)
            paths, val_paths = paths[train.numpy()], paths[val.numpy()]
            labels, val_labels = labels[train.numpy()], labels[val.numpy()]
        if cfg.image_size is not None:
            shape = (3, cfg.image_size, cfg.image_size)
        else:
            assert index.size is not None
            shape = (3, index.size[1], index.size[0])
        return DatasetSplits(
            train=ImageFolderDataset(index.root, paths, labels, cfg.image_size),
            val=ImageFolderDataset(index.root, val_paths, val_labels, cfg.image_size),
            spec=InputSpec(shape, len(index.classes)),
        )


def _root(cfg: DataSection) -> Path:
    """The absolute data directory: the index is keyed by it, identical on every rank."""
    if cfg.dir is None:
        raise UserError("dataset 'imagefolder'", "needs the location of its images", "pass --data-dir DIR")
    root = Path(cfg.dir).expanduser().resolve()
    if not root.is_dir():
        raise UserError(
            f"data directory {root}",
            "does not exist or is not a directory",
            "pass --data-dir DIR/<class>/<image>",
        )
    return root


FORMAT = ImageFolderFormat()
