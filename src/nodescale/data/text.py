"""Plain text files tokenised into cached token files: a ``.txt`` file or a directory of them.

With ``data.text_unit=paragraph`` (the default) each paragraph is a document:
the lines between blank lines (lines of only white space), joined with their
line breaks, the last one dropped. With ``data.text_unit=file`` each file is one
document (read whole, so keep the files small enough for memory). Files are
read as UTF-8, in sorted order of their paths; see ``nodescale.data.tokenised_format``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from nodescale.data.tokenised_format import FilesReader, TokenisedFormat
from nodescale.errors import UserError

if TYPE_CHECKING:
    from nodescale.data.section import DataSection


def documents(path: Path, cfg: DataSection) -> Iterator[str]:
    """The documents of one text file, streamed a line at a time for paragraphs."""
    try:
        with path.open(encoding="utf-8") as file:
            if cfg.text_unit == "file":
                yield file.read()
                return
            lines: list[str] = []
            for line in file:
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield "".join(lines).removesuffix("\n")
                    lines = []
            if lines:
                yield "".join(lines).removesuffix("\n")
    except UnicodeDecodeError as err:
        raise UserError(f"text file {path}", f"is not UTF-8 ({err})", "convert it, e.g. iconv -t UTF-8") from err


FORMAT = TokenisedFormat("text", FilesReader(".txt", documents, ("text_unit",)))
