"""``nodescale data pack``: a dataset as WebDataset-style tar shards with a manifest.

Shard boundaries are drawn first, from the samples' sizes alone, so they do not depend on how
many processes write: shard ``i`` of the list is written by task ``i % tasks`` (a task of a
cluster job: ``RANK``/``WORLD_SIZE``, ``SLURM_PROCID``/``SLURM_NTASKS``, ``PMI_RANK``/``PMI_SIZE``)
and, inside a task, by a pool of processes. Each shard is written atomically, then a record of
it (count, bytes, SHA-256) under ``OUT/.pack/``; the task that finds every record there writes
``manifest.json`` (atomically, identical whoever writes it), so no task waits for another.
Samples keep their original bytes (image files as they are, array rows as ``.npy``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from nodescale.atomic_files import write_atomic, write_json_atomic
from nodescale.data.pack_sources import PackSource, SplitItems, fetch, part, read_source
from nodescale.data.shards import MANIFEST
from nodescale.data.stage import file_sha256
from nodescale.errors import UserError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_TASK_VARIABLES = (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"), ("PMI_RANK", "PMI_SIZE"),
                   ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))


def parse_size(text: str) -> int:
    """``1GB``, ``500MB``, ``64KiB`` or plain bytes, as bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise UserError(f"--shard-size {text!r}", "is not a size", "write e.g. 1GB, 500MB or 256MiB")
    return int(float(match.group(1)) * _UNITS[unit])


def member_bytes(size: int) -> int:
    """What a member of ``size`` bytes takes in a tar: a 512-byte header and its data in 512-byte blocks."""
    return 512 + -(-size // 512) * 512


def plan_shards(sizes: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Consecutive ``(start, stop)`` ranges of samples, each up to ``limit`` bytes of tar (at least one sample)."""
    ranges, start, used = [], 0, 0
    for i, size in enumerate(sizes.tolist()):
        cost = member_bytes(size) + member_bytes(8)  # the data and its .cls
        if i > start and used + cost > limit:
            ranges.append((start, i))
            start, used = i, 0
        used += cost
    if len(sizes):
        ranges.append((start, len(sizes)))
    return ranges


def task_place(environ: dict[str, str] | None = None) -> tuple[int, int]:
    """(rank, tasks) of this process in a cluster job, or (0, 1)."""
    environ = dict(os.environ if environ is None else environ)
    for rank_name, size_name in _TASK_VARIABLES:
        if rank_name in environ and size_name in environ:
            try:
                rank, size = int(environ[rank_name]), int(environ[size_name])
            except ValueError:
                rank, size = -1, 0
            if not 0 <= rank < size:
                raise UserError(f"{rank_name}={environ[rank_name]} {size_name}={environ[size_name]}",
                                "is not a task of the job", "run data pack as a job step (srun, mpiexec)")
            return rank, size
    return 0, 1


@dataclass(frozen=True)
class ShardJob:
    name: str
    split: str
    first_key: int  # the key of the first sample: its index in the split
    items: SplitItems


def write_shard(out: Path, job: ShardJob) -> dict[str, Any]:
    """Write one shard atomically; its record for the manifest."""
    samples = fetch(job.items)

    def write(handle: IO[bytes]) -> None:
        with tarfile.open(fileobj=handle, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for offset, ((ext, data), label) in enumerate(zip(samples, job.items.labels.tolist(), strict=True)):
                key = f"{job.first_key + offset:09d}"
                for name, payload in ((f"{key}.{ext}", data), (f"{key}.cls", str(label).encode())):
                    info = tarfile.TarInfo(name)  # no owner or time: the same input gives the same bytes
                    info.size, info.mode = len(payload), 0o444
                    tar.addfile(info, io.BytesIO(payload))

    path = out / job.name
    write_atomic(path, write)
    counts = np.bincount(job.items.labels).tolist() if len(job.items.labels) else []
    return {"name": job.name, "samples": len(samples), "bytes": path.stat().st_size, "sha256": file_sha256(path),
            "class_counts": counts}


def _jobs(source: PackSource, limit: int) -> list[ShardJob]:
    jobs = []
    for split, items in source.splits.items():
        for number, (start, stop) in enumerate(plan_shards(items.sizes, limit)):
            jobs.append(ShardJob(f"{split}-{number:06d}.tar", split, start, part(items, start, stop)))
    return jobs


def _plan_id(source: PackSource, jobs: list[ShardJob], src: Path) -> str:
    """What the shards were cut from: records of another packing (other source or size) do not count."""
    text = json.dumps([str(src.resolve()), source.format, [(j.name, j.first_key, len(j.items.labels),
                                                            int(j.items.sizes.sum())) for j in jobs]])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pack(src: Path, out: Path, shard_size: int, source_format: str | None = None, workers: int | None = None,
         environ: dict[str, str] | None = None) -> dict[str, Any] | None:
    """Pack this task's shards of ``src`` into ``out``; the manifest if this task completed the set."""
    rank, tasks = task_place(environ)
    source = read_source(src, source_format)
    jobs = _jobs(source, shard_size)
    plan = _plan_id(source, jobs, src)
    mine = jobs[rank::tasks]
    records = out / ".pack"
    records.mkdir(parents=True, exist_ok=True)
    workers = max(1, min(workers or len(os.sched_getaffinity(0)), len(mine) or 1))
    if workers == 1:
        done = [write_shard(out, job) for job in mine]
    else:
        with ProcessPoolExecutor(workers) as pool:
            done = list(pool.map(write_shard, [out] * len(mine), mine))
    for record in done:
        write_json_atomic(records / f"{record['name']}.json", {"plan": plan, "task": rank, **record})
    found = {}
    for job in jobs:  # the manifest: by the task that sees every shard's record
        try:
            record = json.loads((records / f"{job.name}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if record.pop("plan") != plan:
            return None
        found[job.name] = record
    manifest = _manifest(source, jobs, found, src, shard_size)
    write_json_atomic(out / MANIFEST, manifest)
    return manifest


def _manifest(source: PackSource, jobs: list[ShardJob], found: dict[str, Any], src: Path,
              shard_size: int) -> dict[str, Any]:
    splits: dict[str, Any] = {}
    for job in jobs:
        split = splits.setdefault(job.split, {"samples": 0, "class_counts": [0] * len(source.classes), "shards": []})
        record = found[job.name]
        split["samples"] += record["samples"]
        for label, count in enumerate(record["class_counts"]):
            split["class_counts"][label] += count
        split["shards"].append({key: record[key] for key in ("name", "samples", "bytes", "sha256")})
    manifest = {"format": "nodescale-shards", "version": 1, "source": str(src.resolve()),
                "source_format": source.format, "shard_size": shard_size, "classes": source.classes,
                "splits": splits}
    if source.normalise is not None:
        manifest["normalise"] = source.normalise
    return manifest
