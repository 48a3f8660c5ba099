"""``--model hf:DIR``: a local Hugging Face model directory, checked without torch or transformers.

The launcher checks what it can read as plain files (the directory, its
``config.json`` as JSON with a ``model_type``); whether ``transformers`` knows
the architecture is the workers' to say (``models.hf``), since importing it
takes seconds and must not happen where only a configuration is validated.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from nodescale.errors import UserError

HF_PREFIX = "hf:"
CONFIG_FILE = "config.json"
_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_EXAMPLE = "save one with AutoConfig.for_model('llama', ...).save_pretrained(DIR) or model.save_pretrained(DIR)"


def is_hf_model(name: str) -> bool:
    """Whether a model name is ``hf:DIR``."""
    return str(name).startswith(HF_PREFIX)


def hf_dir(name: str) -> Path:
    """The directory of ``hf:DIR``."""
    return Path(str(name)[len(HF_PREFIX):])


def absolute_hf_name(name: str, base: Path) -> str:
    """``hf:DIR`` with a relative DIR made absolute against ``base``."""
    path = hf_dir(name)
    return name if path.is_absolute() else f"{HF_PREFIX}{(base / path).resolve()}"


def hf_label(name: str) -> str:
    """A short, filename-safe name for run directories: the directory's own name."""
    return "hf_" + (_LABEL_UNSAFE.sub("_", hf_dir(name).resolve().name).strip("._") or "model")


def check_hf_dir(name: str) -> dict[str, object]:
    """``DIR/config.json`` as a dict, after checking the directory and the file; else a ``UserError``."""
    what = f"model {name!r}"
    path = hf_dir(name)
    if not str(path).strip():
        raise UserError(what, "names no directory", "give the directory holding config.json: --model hf:/path/to/dir")
    if not path.is_dir():
        raise UserError(what, f"directory {str(path)!r} does not exist",
                        f"give a local directory (relative paths start in {Path.cwd()}); nodescale never downloads "
                        "models: fetch it first, e.g. `hf download ORG/NAME --local-dir DIR`")
    config = path / CONFIG_FILE
    if not config.is_file():
        present = sorted(p.name for p in path.iterdir())[:8]
        raise UserError(what, f"{path} holds no {CONFIG_FILE}",
                        f"point at the directory save_pretrained wrote (it holds: {', '.join(present) or 'nothing'}); "
                        + _EXAMPLE)
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(what, f"{config} is not readable JSON ({exc})", _EXAMPLE) from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise UserError(what, f"{config} names no model_type", f"a transformers config names its architecture, "
                        f"e.g. \"model_type\": \"llama\"; {_EXAMPLE}")
    return data
