"""``metrics.jsonl``: one JSON record per line, written by global rank 0 only."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends records to ``run_dir/metrics.jsonl`` on rank 0; a no-op elsewhere."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self._handle = open(path, "a", buffering=1) if enabled else None  # line-buffered: whole lines

    def write(self, record: dict[str, Any]) -> None:
        if self._handle is not None:
            self._handle.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
