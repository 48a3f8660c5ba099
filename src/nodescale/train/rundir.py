"""The run directory's default name; what may be used, and how, is :mod:`nodescale.engine.run_dir`'s."""

from __future__ import annotations

import time
from pathlib import Path

from nodescale.config.schema import RunConfig
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
