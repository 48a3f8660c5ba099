"""WebDataset-style tar shards (``train-000000.tar``, ...), read by sample through a cached tar index.

``--data-dir`` is a directory (its ``manifest.json`` from ``nodescale data pack``, else its
``train-*.tar`` and ``val-*.tar``, else all its ``*.tar``), a glob (``'DIR/train-*.tar'``) or a
brace list (``'DIR/train-{000000..000009}.tar'``). Validation shards come from ``data.val_dir``
(the same forms), from the directory's ``val-*.tar``, or else ``data.val_fraction`` of the
samples is held out with the run's seed. Every rank reads a contiguous piece of the shards
(``nodescale.data.sharding``); ``data.stage`` copies them to node-local disk first.

A damaged shard (corrupt or truncated) stops the run naming the file, or with
``data.skip_bad_samples`` keeps its samples up to the damage and counts the rest (the
manifest's count) as unreadable samples of weight 0, so that every rank keeps the same steps.
"""

from __future__ import annotations

import glob
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodescale.data.base import DatasetSplits
from nodescale.data.tar_index import ShardIndex, shard_index
from nodescale.errors import UserError

if TYPE_CHECKING:
    from nodescale.data.section import DataSection

MANIFEST = "manifest.json"
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_LIST = re.compile(r"\{([^{}]*,[^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """``{000..009}`` (zero-padded as written) and ``{a,b}`` expanded, left to right."""
    matches = [m for m in (_RANGE.search(pattern), _LIST.search(pattern)) if m is not None]
    if not matches:
        return [pattern]
    match = min(matches, key=lambda m: m.start())  # the leftmost first, as a shell does
    if match.re is _RANGE:
        first, last = match.group(1), match.group(2)
        if int(last) < int(first) or int(last) - int(first) > 1_000_000:
            raise UserError(f"shard pattern {pattern}", f"has the range {{{first}..{last}}}",
                            "write {FIRST..LAST} with FIRST <= LAST")
        choices = [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]
    else:
        choices = match.group(1).split(",")
    head, tail = pattern[:match.start()], pattern[match.end():]
    return [name for choice in choices for name in expand_braces(head + choice + tail)]


def find_shards(location: str, split: str | None = None) -> list[str]:
    """The shard files ``location`` names (a directory's ``split``-*.tar, a glob, a brace list), absolute."""
    path = Path(location).expanduser()
    if path.is_dir():
        manifest = read_manifest(path)
        if manifest is not None and split in manifest["splits"]:
            return [str((path / s["name"]).resolve()) for s in manifest["splits"][split]["shards"]]
        named = sorted(glob.glob(glob.escape(str(path)) + f"/{split}-*.tar")) if split else []
        every = [name for name in sorted(glob.glob(glob.escape(str(path)) + "/*.tar"))
                 if not os.path.basename(name).startswith("val-")]  # a directory without train-*.tar
        found = named or ([] if split == "val" else every)
    else:
        names = expand_braces(str(path))
        found = [hit for name in names for hit in (sorted(glob.glob(name)) if glob.has_magic(name) else [name])]
        missing = [name for name in found if not os.path.isfile(name)]
        if missing:
            raise UserError(f"shard {missing[0]}", "does not exist", "check --data-dir (a directory, a glob "
                            "'DIR/train-*.tar' or a brace list 'DIR/train-{000000..000009}.tar')")
    if not found and split != "val":
        raise UserError(f"--data-dir {location}", "names no tar shards",
                        "pass a directory of train-NNNNNN.tar shards, a glob or a brace list of .tar files")
    return [str(Path(name).resolve()) for name in found]


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """``nodescale data pack``'s manifest in ``directory``, or None."""
    try:
        data = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise UserError(f"{directory / MANIFEST}", f"cannot be read ({err})", "re-run nodescale data pack") from err
    return data if isinstance(data, dict) and isinstance(data.get("splits"), dict) else None


def manifest_of(shards: list[str]) -> dict[str, Any] | None:
    """The manifest beside the first shard, if any."""
    return read_manifest(Path(shards[0]).parent) if shards else None


@dataclass
class ShardSamples:
    """The samples of some shards, in stored order: what ``ShardsDataset`` reads."""

    paths: list[str]
    indexes: list[ShardIndex]
    expected: list[int]  # samples per shard, the manifest's count where damage hides some

    def __len__(self) -> int:
        return sum(self.expected)


def index_shards(paths: list[str], skip_bad: bool, manifest: dict[str, Any] | None) -> ShardSamples:
    """Index every shard; damage stops with a ``UserError`` naming the file, or is warned about with ``skip_bad``."""
    counts = {s["name"]: int(s["samples"]) for split in (manifest or {}).get("splits", {}).values()
              for s in split.get("shards", [])}
    indexes, expected = [], []
    for path in paths:
        index = shard_index(path)
        count = len(index.keys)
        listed = counts.get(os.path.basename(path))
        if index.damage is None and listed is not None and listed != count:
            index.damage = f"holds {count} samples but the manifest lists {listed}"
        if index.damage is not None:
            if not skip_bad:
                raise UserError(f"shard {path}", index.damage,
                                "re-create it (nodescale data pack), or pass --skip-bad-samples to train "
                                "without its unreadable samples")
            lost = max(listed or count, count) - count
            warnings.warn(f"shard {path} {index.damage}: {count} samples kept, {lost} skipped (weight 0)",
                          stacklevel=2)
            count += lost
        indexes.append(index)
        expected.append(count)
    return ShardSamples(paths, indexes, expected)


def _location(cfg: DataSection) -> str:
    if cfg.dir is None:
        raise UserError("dataset 'shards'", "needs the location of its shards",
                        "pass --data-dir DIR (or a glob or brace list of .tar files)")
    return str(cfg.dir)


class ShardsFormat:
    """Tar shards read by sample, each rank a contiguous piece of them."""

    name = "shards"
    needs_dir = True

    def check(self, cfg: DataSection) -> None:
        """The shards exist."""
        find_shards(_location(cfg), "train")
        if cfg.val_dir is not None:
            find_shards(str(cfg.val_dir), "val")

    def prepare(self, cfg: DataSection) -> None:
        """Index every shard once per node (the cache serves the node's other ranks)."""
        for location, split in ((_location(cfg), "train"), (cfg.val_dir, "val")):
            if location is not None:
                for path in find_shards(str(location), split):
                    shard_index(path)

    def load(self, cfg: DataSection, seed: int) -> DatasetSplits:
        """Both sets; the validation one from its own shards or held out with ``seed``."""
        from nodescale.data.shards_dataset import load_splits  # not at the top: see nodescale.data.base

        location = _location(cfg)
        train = find_shards(location, "train")
        val = find_shards(str(cfg.val_dir), "val") if cfg.val_dir is not None else (
            find_shards(location, "val") if Path(location).expanduser().is_dir() else [])
        manifest = manifest_of(train)
        return load_splits(index_shards(train, cfg.skip_bad_samples, manifest),
                           index_shards(val, cfg.skip_bad_samples, manifest_of(val)) if val else None,
                           manifest, cfg, seed)


FORMAT = ShardsFormat()
