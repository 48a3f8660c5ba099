"""References to the user's code, ``FILE.py:FUNCTION`` or ``package.module:FUNCTION``, checked without torch.

The launcher checks a reference before any worker starts: the file exists and
defines the name (read with ``ast``, never executed), or the module can be found
(``importlib`` finders only, so no package ``__init__`` runs and torch stays
unloaded). Everything that needs the code to run is checked by the workers.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from nodescale.errors import UserError, did_you_mean
from nodescale.plugins.hf_dirs import HF_PREFIX, absolute_hf_name, is_hf_model

_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class PluginRef:
    """A parsed reference: a file or a module, and the name of the function in it."""

    text: str  # as given (``role`` and ``text`` name it in errors)
    role: str  # model, dataset or loss
    target: str  # the file's path or the module's dotted name
    function: str
    is_file: bool

    @property
    def what(self) -> str:
        return f"{self.role} {self.text!r}"

    @property
    def label(self) -> str:
        """A short name for run directories: the file's stem or the module's last part, filename-safe."""
        name = Path(self.target).stem if self.is_file else self.target.rpartition(".")[2]
        return _LABEL_UNSAFE.sub("_", name).strip("._") or "plugin"


def is_plugin(name: str) -> bool:
    """Whether a model/dataset/loss name is a reference to the user's code (not a built-in name, not ``hf:DIR``)."""
    return ":" in str(name) and not is_hf_model(name)


def parse_ref(role: str, text: str) -> PluginRef:
    """``text`` split into file or module and function; a malformed one is a ``UserError``."""
    text = str(text).strip()
    if text.startswith(HF_PREFIX):  # only models come from Hugging Face directories (plugins.hf_dirs)
        raise UserError(f"{role} {text!r}", "'hf:' names a Hugging Face model directory, which only --model takes",
                        f"load it in a function of your own: --{role} mycode.py:load")
    target, _, function = text.rpartition(":")
    example = f"--{role} mycode.py:build or --{role} mypackage.mymodule:build"
    if not target or not function.isidentifier():
        raise UserError(f"{role} {text!r}", "must be FILE.py:FUNCTION or package.module:FUNCTION",
                        f"e.g. {example}")
    is_file = _names_a_file(target)
    if not is_file and not all(part.isidentifier() for part in target.split(".")):
        raise UserError(f"{role} {text!r}", f"{target!r} is neither a .py file nor a dotted module name",
                        f"e.g. {example}")
    return PluginRef(text, role, target, function, is_file)


def absolute_ref(text: str, base: Path) -> str:
    """``text`` with a relative file (or ``hf:DIR``) made absolute against ``base``; modules and built-in names
    unchanged."""
    if is_hf_model(text):
        return absolute_hf_name(text, base)
    if not is_plugin(text):
        return text
    target, _, function = str(text).strip().rpartition(":")
    if not _names_a_file(target) or Path(target).is_absolute():
        return text
    return f"{(base / target).resolve()}:{function}"


def _names_a_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def check_ref(role: str, text: str) -> PluginRef:
    """The parsed reference, after checking that its file or module exists and defines the function."""
    ref = parse_ref(role, text)
    if ref.is_file:
        path = Path(ref.target)
        if not path.is_file():
            raise UserError(ref.what, f"file {ref.target!r} does not exist",
                            f"check the path (relative paths start in {Path.cwd()})")
        _check_defines(ref, path)
        return ref
    origin = _module_origin(ref)
    if origin is not None and origin.suffix == ".py" and origin.is_file():
        _check_defines(ref, origin)
    return ref


def defined_names(source: str) -> list[str]:
    """Names a module binds at its top level (defs, classes, assignments, imports), in order.

    Bodies of top-level ``if``/``try``/``with`` blocks count too (``if HAVE_X: def build...``).
    """
    names: list[str] = []

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.extend(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                # "*" stands for a star import: any name may come from it.
                names.extend((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.With)):
                visit(node.body + getattr(node, "orelse", []))
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])

    visit(ast.parse(source).body)
    return names


def _check_defines(ref: PluginRef, path: Path) -> None:
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(ref.what, f"{path} cannot be read as UTF-8 text ({exc})", "check the file") from None
    try:
        names = defined_names(source)
    except SyntaxError as exc:
        raise UserError(ref.what, f"{path} is not valid Python (line {exc.lineno}: {exc.msg})",
                        "fix the syntax; `python -m py_compile FILE` shows the same error") from None
    except RecursionError:
        raise UserError(ref.what, f"{path} is nested too deeply to read", "simplify the file") from None
    if ref.function in names or "*" in names:
        return
    guess = did_you_mean(ref.function, names)
    functions = sorted({n for n in names if not n.startswith("_") and n != "*"})
    hint = f"did you mean {guess!r}?" if guess else \
        (f"names defined there: {', '.join(functions[:12])}" if functions else "define it at the file's top level")
    raise UserError(ref.what, f"{path.name} defines no {ref.function!r} at its top level", hint)


def _module_origin(ref: PluginRef) -> Path | None:
    """The file of module ``ref.target``, found without running any package's ``__init__``.

    ``None`` where finders cannot tell (namespace or extension modules, custom importers):
    the worker's import then decides.
    """
    parts = ref.target.split(".")
    hint = f"install it, add its directory to PYTHONPATH, or name the file: --{ref.role} path/to/{parts[-1]}.py:" \
           f"{ref.function}"
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: found, not imported
    except (ImportError, ValueError):
        return None
    for depth in range(1, len(parts)):
        if spec is None:
            break
        locations = spec.submodule_search_locations
        if locations is None:  # a module, not a package (os.path): only an import can tell
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth + 1]), list(locations))
    if spec is None:
        raise UserError(ref.what, f"no module {ref.target!r} can be imported", hint)
    return Path(spec.origin) if spec.origin and spec.has_location else None
