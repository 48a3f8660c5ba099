"""``nodescale data inspect``: what a dataset holds (format, samples, classes, shards, sizes)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nodescale.data.pack_sources import detect_format
from nodescale.data.section import DataSection


def _bytes_under(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(path) for name in names)


def _shards(location: str) -> dict[str, Any]:
    from nodescale.data.shards import find_shards, manifest_of
    from nodescale.data.tar_index import shard_index

    summary: dict[str, Any] = {"format": "shards", "splits": {}}
    labels: set[int] = set()
    manifest = None
    for split in ("train", "val"):
        paths = find_shards(location, split) if split == "train" or Path(location).is_dir() else []
        indexes = [shard_index(path) for path in paths]
        if not paths:
            continue
        damaged = [f"{index.path} {index.damage}" for index in indexes if index.damage]
        summary["splits"][split] = {"shards": len(paths), "samples": sum(len(i.keys) for i in indexes),
                                    "bytes": sum(os.path.getsize(p) for p in paths), "damaged": damaged}
        labels.update(label for index in indexes for label in index.labels)
        manifest = manifest_of(paths)
    classes = (manifest or {}).get("classes")
    summary["classes"] = len(classes) if classes else len(labels)
    summary["class_names"] = classes
    return summary


def summarise(location: str, name: str | None = None) -> dict[str, Any]:
    """A dataset's summary; ``name`` the format, else detected from the files."""
    name = name or detect_format(Path(location))
    if name == "shards":
        return _shards(location)
    from nodescale.data.registry import get_format

    data_format = get_format(name)
    cfg = DataSection(name=name, dir=Path(location).expanduser().resolve())
    data_format.check(cfg)
    splits = data_format.load(cfg, seed=0)
    return {"format": name, "splits": {"train": {"samples": len(splits.train)}, "val": {"samples": len(splits.val)}},
            "classes": splits.spec.num_classes, "shape": list(splits.spec.shape),
            "bytes": _bytes_under(Path(location))}


def render(summary: dict[str, Any]) -> str:
    """The summary as a few lines of text."""
    lines = [f"format   {summary['format']}"]
    for split, part in summary["splits"].items():
        shards = f" in {part['shards']} shards" if "shards" in part else ""
        size = f", {part['bytes'] / 1e6:.1f} MB" if "bytes" in part else ""
        lines.append(f"{split:<8} {part['samples']} samples{shards}{size}")
        lines += [f"         damaged: {text}" for text in part.get("damaged", [])]
    names = summary.get("class_names")
    lines.append(f"classes  {summary['classes']}" + (f" ({', '.join(names[:8])}{', ...' if len(names) > 8 else ''})"
                                                     if names else ""))
    if "shape" in summary:
        lines.append(f"shape    {tuple(summary['shape'])}")
    if "bytes" in summary:
        lines.append(f"size     {summary['bytes'] / 1e6:.1f} MB")
    return "\n".join(lines)
