"""``metrics.jsonl``: one JSON record per line, written by global rank 0 only."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO


class MetricsLog:
    """Appends records to ``run_dir/metrics.jsonl`` on rank 0; a no-op elsewhere.

    The file is created at the first record, so a run that fails before
    training (bad data, say) leaves no metrics behind to block a rerun.
    """

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled
        self._handle: TextIO | None = None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._handle is None:
            self._handle = open(self.path, "a", buffering=1)  # line-buffered: whole lines
        self._handle.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
