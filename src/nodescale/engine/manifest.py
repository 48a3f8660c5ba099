"""Checkpoint manifests: every file's size and SHA-256, written last, checked before loading.

A manifest is JSON::

    {"format": "nodescale-manifest/1", "algorithm": "sha256",
     "files": {"trainer.pt": {"bytes": 1234, "sha256": "..."}, ...}}

with paths relative to the manifest's directory. It is written atomically
after every file it lists is complete, so its entries say what the files
must be when they are read back. Checking compares sizes first
(a ``stat``, catches truncation at once) and then checksums (catches changed
bytes).

SHA-256 rather than a faster non-cryptographic sum: ``sha256sum FILE`` gives
the same value on any system, to check a file by hand, and with the SHA
instructions of current CPUs (OpenSSL uses them) it hashes 0.7 to 1 GB/s per
core, faster than blake2b (0.5 GB/s) on the machine measured; a 32-bit CRC
(2 GB/s) would save little next to ``torch.save`` itself. Files are hashed in 8 MiB pieces, never read whole. When a
process group is up the files are shared out among the ranks by size, each
hashes its share, and the results are gathered: a sharded checkpoint is
hashed in about the time of one rank's shard.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodescale.atomic_files import write_json_atomic

FORMAT = "nodescale-manifest/1"
ALGORITHM = "sha256"
DIRECTORY_MANIFEST = "manifest.json"  # inside a sharded checkpoint directory
_PIECE = 8 << 20


@dataclass(frozen=True)
class Problem:
    """What is wrong with a checkpoint's files, as a phrase that follows the checkpoint's name."""

    text: str
    manifest_missing: bool = False  # the manifest itself is absent (not unreadable, not contradicted)


def file_digest(path: Path) -> tuple[int, str]:
    """``(bytes read, SHA-256)`` of ``path``, read in pieces."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while piece := handle.read(_PIECE):
            digest.update(piece)
            size += len(piece)
    return size, digest.hexdigest()


def share(sizes: dict[str, int], rank: int, world_size: int) -> list[str]:
    """The names of ``sizes`` that ``rank`` hashes: largest first, each to the least loaded rank.

    Every rank computes the same split from the same sizes, so no one sends it.
    """
    loads = [0] * world_size
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        least = min(range(world_size), key=lambda r: (loads[r], r))
        loads[least] += max(sizes[name], 1)
        if least == rank:
            mine.append(name)
    return mine


def process_group(group: Any = None) -> tuple[int, int] | None:
    """``(rank, world_size)`` in ``group`` (default: the default process group); None without one, or with one rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        return dist.get_rank(group), dist.get_world_size(group)
    return None


def all_gather(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value``, in rank order (a collective of ``group``, default: the default group)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def _digests(directory: Path, sizes: dict[str, int], collective: bool,
             group: Any = None) -> dict[str, tuple[int, str]]:
    """``(bytes, SHA-256)`` of every file in ``sizes``: this rank's share, gathered, when ``collective``."""
    ranks = process_group(group) if collective else None
    rank, world = ranks or (0, 1)
    mine = {name: file_digest(directory / name) for name in share(sizes, rank, world)}
    if ranks is None:
        return mine
    merged: dict[str, tuple[int, str]] = {}
    for part in all_gather(mine, group):
        merged.update(part)
    return merged


def describe_files(directory: Path, names: list[str], collective: bool = False,
                   group: Any = None) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes", "sha256"}}`` for ``names`` (paths relative to ``directory``).

    With ``collective``, every rank of ``group`` (default: the default process group)
    calls it with the same names and hashes its share of them.
    """
    sizes = {name: (directory / name).stat().st_size for name in names}
    digests = _digests(directory, sizes, collective, group)
    # The size recorded is what was hashed: the two always describe the same bytes.
    return {name: {"bytes": digests[name][0], ALGORITHM: digests[name][1]} for name in sorted(names)}


def write(path: Path, files: dict[str, dict[str, Any]]) -> None:
    """Write the manifest ``path`` for ``files`` (from :func:`describe_files`), atomically."""
    write_json_atomic(path, {"format": FORMAT, "algorithm": ALGORITHM, "files": files})


def _read(manifest_path: Path, shown: str) -> tuple[dict[str, Any] | None, Problem | None]:
    """The manifest's file entries, or what is wrong with it (``shown``: its name in messages)."""
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or manifest.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(manifest.get("format"))
        for entry in files.values():
            int(entry["bytes"]), str(entry[ALGORITHM])
    except FileNotFoundError:
        return None, Problem(f"has no manifest ({shown} is missing)", manifest_missing=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, Problem(f"has a damaged manifest: {shown} is unreadable or not a {FORMAT} file "
                             f"({type(exc).__name__})")
    return files, None


def _size_problem(directory: Path, files: dict[str, Any], prefix: str, shown: str) -> Problem | None:
    for name, entry in sorted(files.items()):
        file = directory / name
        if not file.is_file():
            return Problem(f"is incomplete: {prefix}{name} is missing (listed in {shown})")
        size = file.stat().st_size
        if size != entry["bytes"]:
            kind = "truncated" if size < entry["bytes"] else "longer than written"
            return Problem(f"is damaged: {prefix}{name} is {kind} ({size} bytes, {shown} says {entry['bytes']})")
    return None


def problem(manifest_path: Path, collective: bool = False, prefix: str = "") -> Problem | None:
    """What is wrong with the files ``manifest_path`` lists, or None when every one matches.

    Sizes first (a ``stat``: catches truncation at once), checksums only when
    every size is right. With ``collective``, every rank of the default process
    group calls it for the same manifest, each hashes its share, and all reach
    the same verdict (a rank that sees a problem first tells the others).
    ``prefix`` goes before file names in the messages (``step-00000020/``).
    """
    shown = prefix + manifest_path.name
    files, wrong = _read(manifest_path, shown)
    if files is not None:
        wrong = _size_problem(manifest_path.parent, files, prefix, shown)
    if collective and process_group() is not None:
        # Every rank must take the hashing collective below, or none.
        wrong = next((found for found in all_gather(wrong) if found is not None), None)
    if wrong is not None or files is None:
        return wrong
    digests = _digests(manifest_path.parent, {name: entry["bytes"] for name, entry in files.items()}, collective)
    for name in sorted(files):
        if digests[name][1] != files[name][ALGORITHM]:
            return Problem(f"is damaged: {prefix}{name} is corrupt (its SHA-256 differs from the one in {shown})")
    return None
