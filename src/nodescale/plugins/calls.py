"""Import the user's function and call it; a failure shows the user's own frames, not nodescale's.

A mistake in the user's file is the user's to fix, so it becomes a ``UserError``
(exit code 2, no traceback) whose text holds the frames of that file: where it
went wrong, without the dozen frames of nodescale and torch around them. So do
``sys.exit`` and ``KeyboardInterrupt`` inside it: a model function's ``sys.exit(0)``
would otherwise end ``train`` with exit code 0 and no run, and its ``sys.exit(3)``
look like a stop for requeue.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from nodescale.errors import UserError
from nodescale.plugins.refs import PluginRef, parse_ref


def load_function(role: str, text: str) -> tuple[PluginRef, Callable[..., Any]]:
    """The function ``text`` names (``FILE.py:FN`` or ``package.module:FN``), imported."""
    ref = parse_ref(role, text)
    module = _import(ref)
    function = getattr(module, ref.function, None)
    if not callable(function):
        rule = f"{ref.target} defines no {ref.function!r}" if function is None else \
            f"{ref.function!r} in {ref.target} is a {type(function).__name__}, not a function"
        raise UserError(ref.what, rule, f"define def {ref.function}(...) at the top level of {ref.target}")
    return ref, function


def call(ref: PluginRef, function: Callable[..., Any], doing: str, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``; an exception inside it is a ``UserError`` naming ``doing``."""
    try:
        return function(*args, **kwargs)
    except UserError:
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # anything the user's code raises is the user's to fix
        raise user_code_error(ref, exc, doing) from None


def user_code_error(ref: PluginRef, exc: BaseException, doing: str) -> UserError:
    """``exc``, raised by the user's code while ``doing``, as a ``UserError`` showing the user's frames."""
    path = source_file(ref)
    rule = describe_exception(exc, path, doing)
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        hint = f"install {exc.name.split('.')[0]} where the ranks run (pip install ...), or fix the import"
    elif isinstance(exc, SystemExit):
        hint = f"return from {ref.function}() instead of exiting: nodescale ends the run itself"
    elif isinstance(exc, KeyboardInterrupt):
        hint = "a Ctrl-C stops it there; if you pressed none, see why the line shown raises KeyboardInterrupt"
    elif "\n" in rule:
        hint = f"fix {path.name if path else ref.target} at the line shown"
    elif isinstance(exc, TypeError) and "argument" in str(exc):
        section = "model" if ref.role == "model" else "data"
        hint = f"{ref.function}() takes its keyword arguments from --set {section}.args.NAME=VALUE"
    else:
        hint = f"check what nodescale passes to {ref.function}() and what it returns (see docs/training.md)"
    return UserError(ref.what, rule, hint)


def describe_exception(exc: BaseException, path: Path | None, doing: str) -> str:
    """``raised TYPE: MESSAGE (DOING)``, then the frames of ``exc`` that lie in ``path`` (the user's file)."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, SystemExit):
        text = f"called sys.exit({'' if exc.code is None else repr(exc.code)}) ({doing})"
    elif isinstance(exc, KeyboardInterrupt):
        text = f"was interrupted: KeyboardInterrupt ({doing})"
    else:
        text = f"raised {type(exc).__name__}{': ' + message if message else ''} ({doing})"
    frames = user_frames(exc, path)
    return f"{text}\n{frames}" if frames else text


def user_frames(exc: BaseException, path: Path | None) -> str:
    """The frames of ``exc``'s traceback that lie in ``path``, formatted as Python formats them."""
    if path is None:
        return ""
    wanted = str(path.resolve())
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _same_file(f.filename, wanted)]
    return "".join(traceback.format_list(frames)).rstrip()


def defined_at(function: Any) -> str:
    """Where the user's ``function`` (or method) is defined, as a traceback frame: for a mistake in what it returns.

    Empty where Python cannot tell (a builtin, a lambda typed at a prompt).
    """
    try:
        lines, number = inspect.getsourcelines(function)
        filename = inspect.getsourcefile(function)
    except (OSError, TypeError):
        return ""
    if filename is None:
        return ""
    frame = traceback.FrameSummary(filename, number, function.__name__, line=lines[0].strip() if lines else None)
    return "".join(traceback.format_list([frame])).rstrip()


def source_file(ref: PluginRef) -> Path | None:
    """The file holding the user's function (for a module: once imported)."""
    if ref.is_file:
        return Path(ref.target)
    module = sys.modules.get(ref.target)
    origin = getattr(module, "__file__", None)
    return Path(origin) if origin else None


def _same_file(name: str, wanted: str) -> bool:
    try:
        return str(Path(name).resolve()) == wanted
    except (OSError, ValueError):
        return False


def _import(ref: PluginRef) -> ModuleType:
    if not ref.is_file:
        try:
            return importlib.import_module(ref.target)
        except (Exception, SystemExit, KeyboardInterrupt) as exc:  # its top level failed, or it is not there
            if isinstance(exc, ModuleNotFoundError) and exc.name and ref.target.startswith(exc.name):
                raise UserError(ref.what, f"no module {ref.target!r} can be imported",
                                "install it, or add its directory to PYTHONPATH") from None
            raise user_code_error(ref, exc, f"importing {ref.target}") from None
    path = Path(ref.target).resolve()
    # One module per file for the whole process: model, dataset and loss may share a file.
    name = f"_nodescale_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    if not path.is_file():
        raise UserError(ref.what, f"file {str(path)!r} does not exist", "check the path")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # always, for an existing .py path
    module = importlib.util.module_from_spec(spec)
    # As `python FILE` would: the file's own directory is importable, for its helper modules.
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # a script's unguarded sys.exit(main()) too
        del sys.modules[name]
        raise user_code_error(ref, exc, f"running {path.name}'s top level") from None
    return module
