"""Resolve a run's configuration: defaults < YAML file < CLI overrides.

Overrides are dotted keys (``train.batch_size``) so the CLI, ``--set`` and the
library all go through one path. Every failure becomes a ``UserError`` that
names the key (or the flag the user typed), the value, the rule and a hint.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from nodescale import bounded_yaml
from nodescale.config.schema import RunConfig
from nodescale.config.strategy import SECTIONS, error_key
from nodescale.errors import UserError, did_you_mean
from nodescale.plugins.refs import absolute_ref

_LIMIT_HINT = (f"a configuration is at most {bounded_yaml.MAX_BYTES // 1024} KiB, {bounded_yaml.MAX_VALUES:,} values "
               f"and {bounded_yaml.MAX_DEPTH} levels, aliases expanded; write the values out, or pass large "
               "inputs as files your function reads")


def load_config(
    config_file: Path | str | None = None,
    overrides: Mapping[str, Any] | None = None,
    flag_names: Mapping[str, str] | None = None,
) -> RunConfig:
    """The validated configuration from an optional YAML file and dotted-key overrides.

    ``flag_names`` maps dotted keys to the CLI flags that set them, so errors
    can speak the user's language (``--batch-size 0`` rather than
    ``train.batch_size``).
    """
    tree: dict[str, Any] = read_yaml(Path(config_file)) if config_file is not None else {}
    for key, value in (overrides or {}).items():
        set_dotted(tree, key, value)
    return validate(tree, flag_names or {})


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping from ``path``; a missing file or bad YAML is a ``UserError``."""
    if not path.is_file():
        raise UserError(f"config file {str(path)!r}", "does not exist or is not a file",
                        "check the path given to --config")
    try:
        text = bounded_yaml.read_text(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"config file {str(path)!r}", f"cannot be read as UTF-8 text ({exc})",
                        "check the path given to --config; it must be a YAML text file") from None
    except bounded_yaml.LimitError as exc:
        raise UserError(f"config file {str(path)!r}", str(exc), _LIMIT_HINT) from None
    try:
        loaded = bounded_yaml.load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"config file {str(path)!r}", f"is not valid YAML{where}",
                        "fix the syntax; `nodescale config show` prints a valid file") from None
    except bounded_yaml.LimitError as exc:
        raise UserError(f"config file {str(path)!r}", str(exc), _LIMIT_HINT) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise UserError(f"config file {str(path)!r}", "must hold a mapping of sections (model:, data:, ...)",
                        "start from the output of `nodescale config show`")
    return loaded


def parse_assignment(text: str) -> tuple[str, Any]:
    """``"train.epochs=3"`` -> ``("train.epochs", 3)``, the value read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set {text!r}", "must look like KEY=VALUE", "e.g. --set optim.weight_decay=0.05")
    try:
        value = bounded_yaml.load(raw) if raw.strip() else None
    except yaml.YAMLError:  # not YAML: the text itself
        value = raw
    except bounded_yaml.LimitError as exc:
        raise UserError(f"--set {key.strip()}=...", f"its value {exc}", _LIMIT_HINT) from None
    return key.strip(), value


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set ``tree["a"]["b"] = value`` for ``key == "a.b"``, creating sections as needed."""
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"key {key!r}", f"{part!r} is a value, not a section", "check the key's spelling")
        node = child
    node[parts[-1]] = value


def with_absolute_inputs(cfg: RunConfig, base: Path | None = None) -> RunConfig:
    """``cfg`` with its input paths made absolute: ``data.dir``, ``strategy.deepspeed_config``,
    ``model.weights``, and the files of ``FILE.py:FN`` in ``model.name``, ``data.name`` and ``train.loss``.

    A relative path means the directory the command was typed in (``base``, default the
    current one). Stored absolute in the run's config.yaml, it still names the same files when
    the file is reused (``--config RUN/config.yaml``) or a run resumed from somewhere else.
    The run directory (``out``) stays as given: it is printed back to the user.
    """
    base = base or Path.cwd()

    def absolute(path: Path | None) -> Path | None:
        return None if path is None or path.is_absolute() else base / path

    wanted = {
        "data": {"dir": absolute(cfg.data.dir), "name": absolute_ref(cfg.data.name, base)},
        "strategy": {"deepspeed_config": absolute(getattr(cfg.strategy, "deepspeed_config", None))},
        "model": {"weights": absolute(cfg.model.weights), "name": absolute_ref(cfg.model.name, base)},
        "train": {"loss": absolute_ref(cfg.train.loss, base)},
    }
    updates: dict[str, Any] = {}
    for name, fields in wanted.items():
        section = getattr(cfg, name)
        new = {key: value for key, value in fields.items() if value is not None and value != getattr(section, key)}
        if new:
            updates[name] = section.model_copy(update=new)
    return cfg.model_copy(update=updates) if updates else cfg


def validate(tree: dict[str, Any], flag_names: Mapping[str, str]) -> RunConfig:
    """A ``RunConfig`` from a plain tree, with pydantic's errors made readable."""
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise _readable(exc, flag_names) from None


def _readable(exc: ValidationError, flag_names: Mapping[str, str]) -> UserError:
    # Report the first error fully; the user fixes one thing at a time and reruns.
    error = exc.errors()[0]
    key, chosen = error_key(error["loc"])
    shown = flag_names.get(key, key)
    value = error.get("input")
    if error["type"] == "extra_forbidden":
        section_key, _, name = key.rpartition(".")
        known = list(dict.fromkeys(f for model in _section_models(section_key, chosen) for f in model.model_fields))
        guess = did_you_mean(name, known)
        hint = f"did you mean {(section_key + '.' if section_key else '') + guess!r}?" if guess \
            else f"known keys here: {', '.join(known)}"
        return UserError(f"unknown key {key!r}", "is not a setting nodescale knows", hint)
    rule = error["msg"].removeprefix("Value error, ")
    hint = _hint_for(key, error)
    if flag_names.get(key, "").startswith("--"):
        return UserError(f"{shown} {value}", rule, hint)
    return UserError(f"{shown}: value {value!r}", rule, hint)


def _hint_for(key: str, error: Mapping[str, Any]) -> str:
    expected = (error.get("ctx") or {}).get("expected")
    if error["type"] == "literal_error" and expected:
        choices = [part.strip(" '") for part in expected.replace(" or ", ",").split(",")]
        guess = did_you_mean(str(error.get("input")), choices)
        return f"did you mean {guess!r}?" if guess else f"choose one of: {', '.join(choices)}"
    description = field_description(key)
    return f"{key} is the {description}" if description else "see `nodescale config show` for valid values"


def _section_models(section_key: str, chosen: str | None = None) -> list[type[BaseModel]]:
    """The classes of the section at ``section_key``: one, or the strategy section's (``chosen``'s alone)."""
    models: list[type[BaseModel]] = [RunConfig]
    for part in filter(None, section_key.split(".")):
        fields = [model.model_fields[part] for model in models if part in model.model_fields]
        options = [arg for field in fields for arg in (get_args(field.annotation) or (field.annotation,))]
        models = [m for m in options if isinstance(m, type) and issubclass(m, BaseModel)]
    return [SECTIONS[chosen]] if chosen else models


def field_description(key: str) -> str | None:
    """The schema's description of a dotted key (the first strategy's that has it)."""
    section_key, _, name = key.rpartition(".")
    fields = [model.model_fields[name] for model in _section_models(section_key) if name in model.model_fields]
    return fields[0].description if fields else None


def dump_yaml(cfg: RunConfig) -> str:
    """The configuration as YAML that ``--config`` reads back to the same value."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
