"""A file system's refusal, as the user needs it: the path, the cause in words, what to do.

A read-only file system, a file where a directory goes, a name too long, a full disk: none is
a bug in nodescale, and none is fixed by trying again, so each is a ``UserError`` (exit 2)
instead of a traceback.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from nodescale.errors import UserError

_CAUSES = {
    errno.EROFS: ("the file system is read-only", "choose a directory on a writable file system"),
    errno.EACCES: ("permission denied", "choose a directory you may write to"),
    errno.EPERM: ("operation not permitted", "choose a directory you may write to"),
    errno.ENAMETOOLONG: ("a name in the path is too long for the file system",
                         "use shorter names (most file systems allow 255 bytes per name)"),
    errno.ENOSPC: ("no space left on device", "make room, or choose a file system with space"),
    errno.EDQUOT: ("disk quota exceeded", "make room, or choose a file system with space"),
    errno.ELOOP: ("too many levels of symbolic links", "use a path without a loop of links"),
}


def blocking_file(path: Path) -> Path | None:
    """The file (not a directory) at ``path`` or above it, that keeps ``path`` from being a directory."""
    for candidate in [path, *path.parents]:
        try:
            if candidate.exists():
                return None if candidate.is_dir() else candidate
        except OSError:
            continue
    return None


def file_error(what: str, path: Path, error: OSError, otherwise: str, then: str = "",
               doing: str = "written") -> UserError:
    """``error``, met on ``path`` while it was being ``doing``, as a UserError: ``what`` (``--out 'x'``), the
    cause, and the hint: the cause's remedy (``otherwise`` for a cause without one), then ``then``."""
    if error.errno in (errno.ENOTDIR, errno.EEXIST):
        blocking = blocking_file(path)
        if blocking is not None:
            return UserError(what, f"cannot be made: {str(blocking)!r} is a file, not a directory", otherwise)
    cause, remedy = _CAUSES.get(error.errno or 0, (None, None))
    cause = cause or (error.strerror or str(error)).lower()
    where = "" if str(path) in what else f" ({path})"
    hint = (remedy or otherwise) + (f"; {then}" if then else "")
    return UserError(what, f"cannot be {doing}: {cause}{where}", hint)


@contextmanager
def reported(what: str, path: Path, otherwise: str, then: str = "") -> Iterator[None]:
    """An OSError inside becomes :func:`file_error`."""
    try:
        yield
    except OSError as error:
        raise file_error(what, path, error, otherwise, then) from error
