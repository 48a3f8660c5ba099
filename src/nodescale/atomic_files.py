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

from nodescale.errors import UserError


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Create or replace ``path`` with what ``write`` puts into a binary file object.

    A directory at ``path``, or a file where a directory above it goes, is a ``UserError`` naming it:
    nodescale replaces its own files, never removes what someone put in the way.
    """
    if path.is_dir():
        raise in_the_way(path, "a directory", "a file")
    make_directory(path.parent)
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


def make_directory(path: Path) -> None:
    """``path`` and the directories above it, where missing; a file in the way is a ``UserError`` naming it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocking = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), path)
        raise in_the_way(blocking, "a file", "a directory") from None


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


def in_the_way(path: Path, found: str, needed: str) -> UserError:
    """The error for ``found`` (a file, a directory) at ``path`` where nodescale writes ``needed``."""
    return UserError(f"{path}", f"is {found}, where nodescale writes {needed}",
                     "move or delete it (nodescale does not remove what it did not write), or choose another --out")
