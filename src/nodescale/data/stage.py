"""Copy a shard to node-local disk (``data.stage``) before training reads it.

On a parallel filesystem every rank reading its shards at once competes for the metadata and
object servers; a copy on the node's own disk is read at local speed from the second epoch on
(and from the first, for the shards already there). The copy is atomic (a rank on the same
node sharing a shard may copy it at the same time), checked against the manifest's SHA-256,
and skipped where a file with that checksum is already there. Torch-free.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import IO

from nodescale.atomic_files import write_atomic
from nodescale.errors import UserError

_CHUNK = 8 * 1024 * 1024


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file, read in large chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def stage_file(source: str, stage_dir: str, checksum: str | None) -> str:
    """The local copy of ``source`` under ``stage_dir``, made now unless an identical one is there.

    Without a manifest's ``checksum`` the source is hashed (a read, no write) to compare.
    """
    # Shards of different directories may share names: one folder per source directory.
    folder = hashlib.sha256(os.path.dirname(source).encode("utf-8", "surrogateescape")).hexdigest()[:12]
    target = Path(stage_dir) / folder / os.path.basename(source)
    try:
        if target.is_file() and target.stat().st_size == os.path.getsize(source):
            if file_sha256(target) == (checksum or file_sha256(source)):
                return str(target)

        def copy(handle: IO[bytes]) -> None:
            digest = hashlib.sha256()
            with open(source, "rb") as src:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    handle.write(chunk)
            if checksum is not None and digest.hexdigest() != checksum:
                raise UserError(f"shard {source}", f"has SHA-256 {digest.hexdigest()}, the manifest says {checksum}",
                                "the shard changed or is damaged: re-create it with nodescale data pack")

        write_atomic(target, copy)
    except OSError as err:
        raise UserError(f"--stage {stage_dir}", f"cannot hold a copy of {source} ({err})",
                        "pass a writable node-local directory with room for this rank's shards "
                        f"({shutil.disk_usage(stage_dir).free if os.path.isdir(stage_dir) else 0} bytes free)") from err
    return str(target)
