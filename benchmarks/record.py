"""What every benchmark script shares around its measurements: the console and the results file."""

from __future__ import annotations

import datetime as dt
import shlex
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from nodescale.atomic_files import write_json_atomic


def wide_console(width: int) -> Console:
    """A rich console; writing to a log file or a pipe, ``width`` columns, so a table's rows stay on one line."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = width
    return console


def stamp() -> dict[str, str]:
    """When and how the benchmark was run: the first keys of every results file."""
    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }


def cpu_model() -> str:
    """The processor's name as Linux reports it ("unknown" elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def write_results(out: Path, record: dict[str, Any], console: Console) -> None:
    """Write the results JSON atomically (a killed benchmark leaves the previous file whole) and say where."""
    write_json_atomic(out, record)
    console.print(f"wrote {out}")
