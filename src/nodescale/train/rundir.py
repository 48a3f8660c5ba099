"""The run directory: chosen once, agreed by every rank, never silently reused."""

from __future__ import annotations

import time
from pathlib import Path

from nodescale.config.schema import RunConfig
from nodescale.errors import UserError
from nodescale.plugins.hf_dirs import hf_label, is_hf_model
from nodescale.plugins.refs import is_plugin, parse_ref

RUNS_ROOT = Path("runs")


def default_run_dir(cfg: RunConfig) -> Path:
    """``runs/<model>-<dataset>-<YYYYmmdd-HHMMSS>`` under the current directory.

    The user's ``/abs/path/mynet.py:build`` counts as ``mynet`` (``hf:/models/tiny`` as
    ``hf_tiny``): a path would nest directories, and its characters are not all safe in file names.
    """
    return RUNS_ROOT / f"{_label(cfg.model.name)}-{_label(cfg.data.name)}-{time.strftime('%Y%m%d-%H%M%S')}"


def _label(name: str) -> str:
    if is_hf_model(name):
        return hf_label(name)
    return parse_ref("model", name).label if is_plugin(name) else name


def run_files_in(run_dir: Path) -> list[str]:
    """What of a run ``run_dir`` already holds (metrics, summary, checkpoints): empty for a fresh directory."""
    return [name for name in ("metrics.jsonl", "summary.json", "checkpoints") if (run_dir / name).exists()]


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Refuse to mix a new run into the files of an old one.

    A directory that already holds metrics or checkpoints is continued with
    ``--resume`` or not used at all: appending a fresh run's metrics to an old
    run's, or overwriting its checkpoints, would lose or corrupt results.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--out {str(run_dir)!r}", "exists and is not a directory", "choose another --out")
    if resume:
        return
    used = run_files_in(run_dir)
    if used:
        raise UserError(
            f"--out {str(run_dir)!r}",
            f"already holds a run ({', '.join(used)})",
            "pass --resume to continue it, or choose another --out",
        )
