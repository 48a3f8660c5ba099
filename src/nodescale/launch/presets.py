"""Cluster presets: built-in YAML files, overridden by the user's own.

A preset named NAME is looked up first in the user's preset directory
(``$NODESCALE_PRESET_DIR``, else ``$XDG_CONFIG_HOME/nodescale/presets``, else
``~/.config/nodescale/presets``) as ``NAME.yaml``, then among the files shipped
in ``nodescale/launch/presets/``. A user file replaces the built-in of the
same name, or, with ``extends: BUILTIN``, starts from that built-in and adds to it:
lists (``modules``, ``setup``, ``directives``) are appended to the built-in's,
``env`` is merged variable by variable, any other key replaces the built-in's
value. Adding is the common case (a container, one more module or variable); to
drop something a built-in sets, copy its file instead of extending it.
"""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

from nodescale import bounded_yaml
from nodescale.errors import UserError, did_you_mean
from nodescale.launch.checks import walltime_seconds
from nodescale.launch.envcheck import check_env
from nodescale.launch.spec import Preset

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_SUFFIX = ".yaml"
EXTENDS = "extends"


def user_preset_dir(user_dir: Path | None = None) -> Path:
    """Where the user's presets live (the directory need not exist)."""
    if user_dir is not None:
        return Path(user_dir)
    if os.environ.get("NODESCALE_PRESET_DIR"):
        return Path(os.environ["NODESCALE_PRESET_DIR"]).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "nodescale" / "presets"


def _builtin_dir() -> Traversable:
    # Resolved through the package, so it works from a wheel, an sdist or an editable checkout.
    return resources.files("nodescale.launch").joinpath("presets")


def builtin_presets() -> list[str]:
    """Names of the presets shipped with nodescale."""
    return sorted(entry.name[: -len(_SUFFIX)] for entry in _builtin_dir().iterdir() if entry.name.endswith(_SUFFIX))


def _user_names(user_dir: Path | None) -> list[str]:
    folder = user_preset_dir(user_dir)
    return sorted(path.stem for path in folder.glob(f"*{_SUFFIX}") if path.is_file()) if folder.is_dir() else []


def list_presets(user_dir: Path | None = None) -> list[str]:
    """Every preset name: the built-ins and the user's own, sorted, each once."""
    return sorted(set(builtin_presets()) | set(_user_names(user_dir)))


def load_preset(name: str, user_dir: Path | None = None) -> Preset:
    """The preset ``name``: the user's file if there is one, else the built-in.

    Raises :class:`UserError` for an unknown name (with a did-you-mean), a file that is not
    valid YAML, or a key or value the :class:`Preset` model rejects (naming file, key and rule).
    """
    if not _NAME.match(name):
        raise UserError(f"--cluster {name!r}", "a preset name is lower-case letters, digits, '-' and '_'",
                        f"known presets: {', '.join(list_presets(user_dir))}")
    user_file = user_preset_dir(user_dir) / f"{name}{_SUFFIX}"
    if user_file.is_file():
        return _load_user(user_file, name)
    if name in builtin_presets():
        return _load_builtin(name)
    known = list_presets(user_dir)
    guess = did_you_mean(name, known)
    hint = f"did you mean {guess!r}?" if guess else \
        f"known presets: {', '.join(known)}; or write {user_file} (start from a built-in)"
    raise UserError(f"--cluster {name!r}", "no such cluster preset", hint)


def _load_builtin(name: str) -> Preset:
    entry = _builtin_dir().joinpath(f"{name}{_SUFFIX}")
    where = f"built-in preset {name!r}"
    return _validate(_parse(entry.read_text(encoding="utf-8"), where), where, name)


def _load_user(path: Path, name: str) -> Preset:
    where = f"preset file {str(path)!r}"
    try:
        text = bounded_yaml.read_text(path)
    except bounded_yaml.LimitError as exc:
        raise UserError(where, str(exc), "a preset is a short mapping of keys") from None
    tree = _parse(text, where)
    base_name = tree.pop(EXTENDS, None)
    if base_name is not None:
        if not isinstance(base_name, str) or base_name not in builtin_presets():
            guess = did_you_mean(str(base_name), builtin_presets())
            raise UserError(f"{where}: key {EXTENDS!r}", f"{base_name!r} is not a built-in preset",
                            f"did you mean {guess!r}?" if guess else f"built-ins: {', '.join(builtin_presets())}")
        tree = _extend(_load_builtin(base_name).model_dump(exclude_none=True), tree)
    return _validate(tree, where, name)


def _extend(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes``: lists appended, mappings merged, anything else replaced."""
    merged = dict(base)
    merged.pop("name", None)  # the user file's name (its file name) is the preset's name
    for key, value in changes.items():
        old = merged.get(key)
        if isinstance(old, list) and isinstance(value, list):
            merged[key] = old + value
        elif isinstance(old, dict) and isinstance(value, dict) and key != "container":
            merged[key] = {**old, **value}
        else:
            merged[key] = value
    return merged


def _parse(text: str, where: str) -> dict[str, Any]:
    try:
        loaded = bounded_yaml.load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None)
        raise UserError(where, f"is not valid YAML{at}" + (f" ({problem})" if problem else ""),
                        "check the indentation and quote values containing ':' or '#'") from None
    except bounded_yaml.LimitError as exc:
        raise UserError(where, str(exc), "a preset is a short mapping of keys; write its values out") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise UserError(where, "must be a mapping of preset keys (name:, scheduler:, gpus_per_node:, ...)",
                        "start from a built-in preset's file")
    return loaded


def _validate(tree: dict[str, Any], where: str, name: str) -> Preset:
    tree.setdefault("name", name)
    if tree["name"] != name:
        raise UserError(f"{where}: key 'name'", f"{tree['name']!r} differs from the file's name {name!r}",
                        f"set name: {name}, or rename the file")
    try:
        preset = Preset.model_validate(tree)
    except ValidationError as exc:
        raise _readable(exc, where) from None
    if preset.max_time is not None:
        try:
            walltime_seconds(preset.max_time)
        except ValueError as exc:
            raise UserError(f"{where}: key 'max_time'", str(exc), 'write it as "HH:MM:SS" or "D-HH:MM:SS"') from None
    try:
        check_env(preset.env)
    except UserError as exc:
        raise UserError(f"{where}: key 'env': {exc.what}", exc.rule, exc.hint) from None
    return preset


def _readable(exc: ValidationError, where: str) -> UserError:
    # One error, fully: the user fixes one thing and reloads. A misspelt key comes first, since it
    # usually explains the "missing" error of the key it was meant to be.
    errors = exc.errors()
    error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        guess = did_you_mean(key.split(".")[-1], list(Preset.model_fields) + [EXTENDS])
        hint = f"did you mean {guess!r}?" if guess else f"preset keys: {', '.join(Preset.model_fields)}"
        return UserError(f"{where}: key {key!r}", "is not a preset key", hint)
    rule = error["msg"].removeprefix("Value error, ")
    field = Preset.model_fields.get(str(error["loc"][0]))
    hint = f"{key} is the {field.description}" if field and field.description else "see a built-in preset's file"
    if error["type"] == "missing":
        return UserError(f"{where}: key {key!r}", "is required", hint)
    return UserError(f"{where}: key {key!r} = {error.get('input')!r}", rule, hint)
