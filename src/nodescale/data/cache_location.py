"""Where formats keep what they derive from a dataset once per node (file indexes, token files)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "NODESCALE_CACHE_DIR"


def cache_dir() -> Path:
    """``$NODESCALE_CACHE_DIR`` or ``~/.cache/nodescale``."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/nodescale").expanduser()
