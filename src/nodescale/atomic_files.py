"""Write files so that readers see the old content or the new, never half of it.

Write to a temporary file in the same directory, flush it to disk, then
``os.replace`` it over the target (atomic on POSIX file systems, Lustre and
GPFS included) and sync the directory so the rename survives a crash.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Create or replace ``path`` with what ``write`` puts into a binary file object."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    sync_directory(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """Create or replace ``path`` with ``text`` (UTF-8)."""
    write_atomic(path, lambda handle: handle.write(text.encode()))


def write_json_atomic(path: Path, data: Any) -> None:
    """Create or replace ``path`` with ``data`` as indented JSON."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def sync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (for files written by other libraries, then renamed)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories; the rename still happened
        pass
    finally:
        os.close(fd)
