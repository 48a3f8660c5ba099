"""``metrics.csv``: the scalars of every step and epoch record, one row each, for spreadsheets and pandas."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, TextIO

from nodescale.observe.sink import SCALAR_NAMES, Status

# Fixed columns, so a resumed run appends rows that line up with the first part's. A file begun by another
# version keeps its own header: its columns are filled, others are left to metrics.jsonl.
COLUMNS: tuple[str, ...] = ("time", "kind", "step", "epoch",
                            *dict.fromkeys(key for names in SCALAR_NAMES.values() for key in names))


class CsvSink:
    """Appends one row per step or epoch record; empty cells where a kind has no such value."""

    name = "csv"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: TextIO | None = None
        self._writer: Any = None

    def start(self, config: dict[str, Any], resumed: bool) -> None:
        header: list[str] = []
        if self.path.exists():
            with open(self.path, newline="") as existing:
                header = next(csv.reader(existing), [])
        self._handle = open(self.path, "a", newline="", buffering=1)
        self._writer = csv.DictWriter(self._handle, fieldnames=header or COLUMNS, extrasaction="ignore")
        if not header:
            self._writer.writeheader()

    def write(self, record: dict[str, Any]) -> None:
        if self._writer is None or record.get("kind") not in SCALAR_NAMES:
            return
        self._writer.writerow({key: "" if record.get(key) is None else record[key] for key in self._writer.fieldnames})

    def finish(self, summary: dict[str, Any] | None, status: Status) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = self._writer = None
