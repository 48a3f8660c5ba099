"""What a test needs from the machine, skipped where it is missing, except in CI.

A test extra that is not installed, or a program that is not on PATH, skips the tests that need it,
with the reason; where the ``CI`` variable is set it fails them instead, so that CI never passes by
skipping. ``bash scripts/test-setup.sh`` installs everything. Programs: ``scheduler_fixtures.require``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest


def unavailable(reason: str) -> NoReturn:
    """Skip (the whole module, when called while it is imported), or fail where CI is set."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: a missing requirement is a failure here, not a skip)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str, what: str) -> ModuleType:
    """The package ``name`` (one of the test extras), imported; skipped (or failed where CI is set) when it
    is not installed. One that is installed but fails to import is an error, as anywhere else."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name.partition(".")[0]:
            raise
        unavailable(f"{what} needs {name}: `bash scripts/test-setup.sh` installs the test extras")
