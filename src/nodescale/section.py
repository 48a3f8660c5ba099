"""What every section of a run's configuration shares: its base class and the check of a name.

Each component owns its section (``data.section``, ``models.section``); ``nodescale.config``
assembles them into the run's tree. This module sits below all of them and imports none.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

from nodescale.errors import unknown_choice
from nodescale.plugins.hf_dirs import check_hf_dir, is_hf_model
from nodescale.plugins.refs import check_ref, is_plugin


def known_or_plugin(kind: str, value: str, choices: Iterable[str]) -> str:
    """A built-in name, or a user's ``FILE.py:FN`` / ``package.module:FN`` (its file read, none of it run),
    or for a model ``hf:DIR`` (its config.json read as JSON)."""
    if is_hf_model(value) and kind == "model":
        check_hf_dir(value)
    elif is_plugin(value) or is_hf_model(value):  # a dataset's or loss's hf: gets parse_ref's message
        check_ref(kind, value)
    elif value not in choices:
        raise unknown_choice(kind, value, choices)
    return value


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
