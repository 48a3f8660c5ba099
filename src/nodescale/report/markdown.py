"""Markdown building blocks: number formats (the same as the console's) and tables."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MISSING = "n/a"


def cell(text: Any) -> str:
    """``text`` made safe for a table cell: pipes escaped, line breaks removed."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align_right_from: int = 1) -> str:
    """A GitHub-flavoured markdown table; columns from ``align_right_from`` on are right-aligned (numbers)."""
    rule = ["---" if index < align_right_from else "---:" for index in range(len(headers))]
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def number(value: float | None, digits: int = 1) -> str:
    """``1234.56`` -> ``"1,234.6"``; ``None`` -> ``n/a``."""
    return MISSING if value is None else f"{value:,.{digits}f}"


def milliseconds(seconds: float | None) -> str:
    """Seconds shown in milliseconds with 2 decimals (the console's step time)."""
    return MISSING if seconds is None else f"{seconds * 1000:,.2f}"


def percent(fraction: float | None, digits: int = 2) -> str:
    """``0.9331`` -> ``"93.31%"``."""
    return MISSING if fraction is None else f"{fraction:.{digits}%}"


def megabytes(count: float | None, digits: int = 1) -> str:
    """Bytes in MB (1e6 bytes)."""
    return MISSING if count is None else f"{count / 1e6:,.{digits}f}"


def link(text: str, target: str) -> str:
    """A markdown link; spaces in the target are escaped so the link survives."""
    return f"[{text}]({target.replace(' ', '%20')})"


def image(alt: str, target: str) -> str:
    """A markdown image."""
    return "!" + link(alt, target)


def directory_link(path: Path, report_dir: Path) -> str:
    """A link to ``path`` relative to the report, or "this directory" when the report is written inside it."""
    target = os.path.relpath(path, report_dir)
    return "this directory" if target == "." else link(target, target)
