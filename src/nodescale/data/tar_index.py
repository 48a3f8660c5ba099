"""Where each sample of a WebDataset-style tar shard lies: built once per shard, cached, then random access.

The ``webdataset`` library streams a shard from its start and shuffles through a buffer whose
state a checkpoint cannot hold, so a resume mid-epoch would not be exact. nodescale reads
shards itself instead: one pass over the tar headers (Python's ``tarfile``) records the offset
and size of every sample's data and its label, into a small JSON file in the cache, written
atomically and keyed by the shard's path, size and modification time. A sample is then one
seek and one read, in whatever order the epoch asks.

A sample is the tar members sharing a key (the name up to the first dot of its last part):
``KEY.jpg``/``.png``/... or ``KEY.npy`` with its label in ``KEY.cls`` (a decimal integer) or in
``KEY.json`` (its ``cls`` or ``label`` field). Torch-free: the launcher's checks import it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodescale.atomic_files import write_json_atomic
from nodescale.data.cache_location import cache_dir
from nodescale.errors import UserError

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "bmp", "ppm", "gif", "webp")
DATA_EXTENSIONS = (*IMAGE_EXTENSIONS, "npy")
INDEX_VERSION = 1


@dataclass
class ShardIndex:
    """The readable samples of one shard, in stored order, and what went wrong after them."""

    path: str
    keys: list[str] = field(default_factory=list)
    exts: list[str] = field(default_factory=list)  # the data member's extension
    offsets: list[int] = field(default_factory=list)  # of the data member's bytes in the file
    sizes: list[int] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    damage: str | None = None  # why reading stopped early (a corrupt or truncated tar), or None


def split_name(name: str) -> tuple[str, str]:
    """A member name as (key, extension), WebDataset's way: the extension starts at the first dot of the base."""
    directory, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), ext.lower()


def _label(ext: str, data: bytes, path: str, key: str) -> int:
    try:
        if ext == "cls":
            label = int(data.decode().strip())
        else:
            value = json.loads(data)
            label = value.get("cls", value.get("label")) if isinstance(value, dict) else None
            if isinstance(label, bool) or not isinstance(label, int):
                raise ValueError("no integer 'cls' or 'label' field")
        if not -(2**63) <= label < 2**63:  # labels become an int64 column (negatives are refused with the rest)
            raise ValueError(f"{label} does not fit in 64 bits; a class is a number from 0")
        return label
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"shard {path}, sample {key}", f"has an unreadable label in {key}.{ext} ({err})",
                        "write the class as a decimal integer in KEY.cls, or as {\"cls\": N} in KEY.json") from err


def _end_damage(tar: tarfile.TarFile, size: int) -> str | None:
    """Why the archive does not end as a whole one does (with two zero blocks), or None.

    ``tarfile`` ends its listing silently at a header cut short or garbled after the first, so
    a shard truncated between members, or damaged in a header, shows only here.
    """
    end = tar.offset  # just after the last member read
    tar.fileobj.seek(end)  # type: ignore[union-attr]
    rest = tar.fileobj.read(size - end) if size - end <= 1 << 20 else b"x"  # type: ignore[union-attr]
    if len(rest) >= 1024 and not rest.strip(b"\0"):
        return None
    what = "is truncated" if len(rest) < 1024 else "has a damaged header"
    return f"{what}: the readable members end at byte {end}, the file has {size}"


def build_index(path: str) -> ShardIndex:
    """Read the headers of the tar at ``path``; damage ends the index, the samples before it stay."""
    index = ShardIndex(path)
    size = os.path.getsize(path)
    pending: dict[str, Any] = {}  # the sample being read: key, its data member, its label
    samples: list[dict[str, Any]] = []
    try:
        with tarfile.open(path, mode="r:") as tar:
            while (member := tar.next()) is not None:
                if member.offset_data + member.size > size:
                    index.damage = (f"is truncated: member {member.name} ends at byte "
                                    f"{member.offset_data + member.size}, the file has {size}")
                    break
                if not member.isfile():
                    continue
                key, ext = split_name(member.name)
                if key != pending.get("key"):
                    pending = {"key": key}
                    samples.append(pending)
                if ext in DATA_EXTENSIONS:
                    pending.update(ext=ext, offset=member.offset_data, size=member.size)
                elif ext in ("cls", "json") and "label" not in pending:
                    handle = tar.extractfile(member)
                    assert handle is not None  # a regular file
                    pending["label"] = _label(ext, handle.read(), path, key)
            if index.damage is None:
                index.damage = _end_damage(tar, size)
    except (tarfile.TarError, EOFError) as err:
        index.damage = f"is not a readable tar archive after {len(samples)} samples ({err})"
    if index.damage is not None and samples:
        samples.pop()  # the sample being read when the damage began may have lost a member
    for sample in samples:
        if "ext" not in sample:
            continue  # metadata without an input (e.g. __key__.txt alone) is not a sample
        if "label" not in sample:
            raise UserError(f"shard {path}, sample {sample['key']}", "has no label",
                            f"add {sample['key']}.cls (the class as a decimal integer) or {sample['key']}.json "
                            "with a 'cls' field")
        index.keys.append(sample["key"])
        index.exts.append(sample["ext"])
        index.offsets.append(sample["offset"])
        index.sizes.append(sample["size"])
        index.labels.append(sample["label"])
    return index


def _cache_path(path: str, stat: os.stat_result) -> Path:
    ident = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode("utf-8", "surrogateescape")
    return cache_dir() / "shards" / f"{hashlib.sha256(ident).hexdigest()[:24]}.json"


def shard_index(path: str) -> ShardIndex:
    """The index of the shard at ``path`` (absolute), from the cache or built and cached."""
    try:
        stat = os.stat(path)
    except OSError as err:
        raise UserError(f"shard {path}", f"cannot be read ({err.strerror})", "check the path and its rights") from err
    cached = _cache_path(path, stat)
    try:
        data = json.loads(cached.read_text(encoding="utf-8"))
        if data.pop("version") == INDEX_VERSION and data["path"] == path:
            return ShardIndex(**data)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing or damaged: build it
    index = build_index(path)
    try:
        write_json_atomic(cached, {"version": INDEX_VERSION, **index.__dict__})
    except OSError:  # a read-only cache: every process indexes for itself, which is only slower
        pass
    return index
