"""The small JSON file in which a logger keeps its own run's id, so a resumed nodescale run continues it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_run_file(path: Path) -> dict[str, Any]:
    """The file's object; {} when it is missing, unreadable or not an object (a fresh logger run then starts)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
