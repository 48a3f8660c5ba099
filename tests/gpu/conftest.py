"""The CUDA paths: collected everywhere, run only where a CUDA device is visible.

CI has no GPU, so these skip there (a GPU is not a component CI can be required to have);
`scripts/gpu-check.sh` runs them on a lent GPU machine, where they must pass.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device here: run scripts/gpu-check.sh on a GPU machine")
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/") or item.get_closest_marker("gpu"):
            item.add_marker(skip)
