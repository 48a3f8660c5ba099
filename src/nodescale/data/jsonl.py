"""JSON Lines tokenised into cached token files: a ``.jsonl`` file or a directory of them.

Each non-blank line is one JSON object, one document, whose text is under
``data.text_key`` (default ``text``); other keys are ignored. Files are read in
sorted order of their paths; see ``nodescale.data.tokenised_format``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from nodescale.data.tokenised_format import FilesReader, TokenisedFormat
from nodescale.errors import UserError

if TYPE_CHECKING:
    from nodescale.data.section import DataSection


def documents(path: Path, cfg: DataSection) -> Iterator[str]:
    """The text of each line's object, with the file and line number of any line that has none."""
    key = cfg.text_key
    with path.open("rb") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:  # UnicodeDecodeError included
                raise UserError(f"{path}:{number}", f"is not a JSON object ({err})",
                                "write one JSON object per line, e.g. {\"text\": \"...\"}") from err
            text = record.get(key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise UserError(f"{path}:{number}", f"has no text under key {key!r} ({_found(record, key)})",
                                "name the key that holds each document's text: --set data.text_key=KEY")
            yield text


def _found(record: object, key: str) -> str:
    if not isinstance(record, dict):
        return f"the line holds a JSON {type(record).__name__}, not an object"
    if key in record:
        return f"it holds a {type(record[key]).__name__}, not a string"
    keys = list(record)
    return f"its keys: {', '.join(map(repr, keys[:10]))}{' ...' if len(keys) > 10 else ''}" if keys else "no keys"


FORMAT = TokenisedFormat("jsonl", FilesReader(".jsonl", documents, ("text_key",)))
