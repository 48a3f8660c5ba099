"""Golden files: rendered text compared with a recorded copy, rewritten only on purpose."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

GOLDEN_ROOT = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("NODESCALE_UPDATE_GOLDEN") == "1"
HINT = "if this change is intended, rerun with NODESCALE_UPDATE_GOLDEN=1 and review the diff"


def check_golden(path: Path, text: str) -> None:
    """Fail with a diff unless ``text`` equals the file at ``path``; with NODESCALE_UPDATE_GOLDEN=1, rewrite it."""
    shown = path.relative_to(GOLDEN_ROOT.parent)
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"golden file {shown} does not exist; {HINT}", pytrace=False)
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True), text.splitlines(keepends=True),
                                            str(shown), "rendered"))
        pytest.fail(f"the rendered script differs from {shown}:\n{diff}\n{HINT}", pytrace=False)
