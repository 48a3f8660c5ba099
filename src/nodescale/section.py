"""What every section of a run's configuration shares: its base class and the check of a name.

Each component owns its section (``data.section``, ``models.section``); ``nodescale.config``
assembles them into the run's tree. This module sits below all of them and imports none.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

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


# The widest whole number a setting may hold unless its field says otherwise: what becomes
# torch's int64 (sizes, counts, steps) must fit, or the ranks fail on it after starting.
INT64_MAX = 2**63 - 1
# The longest timeout or interval: torch counts its timeouts in int64 nanoseconds (9.2e9 s, the
# same as threading.TIMEOUT_MAX); a round 10^8 s (over 3 years) leaves room for sums of them.
MAX_SECONDS = 1e8


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated, numbers are finite
    (inf is refused like NaN) and whole numbers fit in 64 bits."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _fits_int64(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields[info.field_name]
        # A field with its own upper bound has said what fits; args go to the user's function as they are.
        if info.field_name == "args" or any(hasattr(rule, "le") or hasattr(rule, "lt") for rule in field.metadata):
            return value
        wide = _too_wide(value)
        if wide is not None:
            raise ValueError(f"{wide} is out of range: whole numbers here are at most 2**63-1 ({INT64_MAX})")
        return value


def _too_wide(value: Any) -> int | None:
    """The first whole number in ``value`` (or its lists and mappings) that int64 cannot hold, or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if not -INT64_MAX - 1 <= value <= INT64_MAX else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((wide for item in items if (wide := _too_wide(item)) is not None), None)
