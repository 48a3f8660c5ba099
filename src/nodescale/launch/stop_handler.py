"""Who acts on the stop signal a cluster job gets before its wall time: decided per command, said at submission.

- ``nodescale``: the ranks are nodescale's (``nodescale train``, a script on ``nodescale.init`` or
  :mod:`nodescale.preemption`): they checkpoint, write the requeue marker, and the job script requeues;
- ``framework``: a framework that requeues the job itself (Lightning, under srun with one task per
  process): the signal reaches it, and nodescale does not requeue a second time;
- ``none``: nobody would act on it, so it is not sent: the job runs until the wall time ends it.

Without ``--stop-handler`` the command decides: nodescale's own, or what a Python script imports,
read with :mod:`ast` and never run (the script and the modules beside it that it imports, bounded
in size and number).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nodescale.errors import UserError, unknown_choice

Handler = Literal["nodescale", "framework", "none"]
HANDLERS: tuple[Handler, ...] = ("nodescale", "framework", "none")
DEFAULT_MAX_REQUEUES = 20

# Reading a user's files: none larger, no more of them (a script's own modules beside it).
MAX_SCRIPT_BYTES = 2_000_000
MAX_FILES = 50
_LIGHTNING = ("lightning", "pytorch_lightning")


@dataclass(frozen=True)
class Decision:
    handler: Handler
    why: str  # what it was decided from, said in brackets


def decide(command: list[str], given: str | None, scheduler: str, mode: str, workdir: Path) -> Decision:
    """The stop handler of ``command``: ``given`` (``--stop-handler``), else what the command shows."""
    if given is not None:
        if given not in HANDLERS:
            raise unknown_choice("--stop-handler", given, HANDLERS)
        if given == "framework" and scheduler == "pbs":
            raise UserError("--stop-handler framework with PBS", "no framework requeues a PBS job itself "
                            "(Lightning does so on Slurm only)", "use --stop-handler nodescale with "
                            "nodescale.preemption in the script (docs/launch.md), or --stop-handler none")
        return Decision(given, "--stop-handler")
    if _is_nodescale_train(command):
        return Decision("nodescale", "nodescale train")
    script = script_of(command, workdir)
    if script is None:
        return Decision("none", "not a Python script nodescale can read")
    names = imported_names(script, workdir)
    shown = script.name
    if "nodescale" in names:
        return Decision("nodescale", f"{shown} imports nodescale")
    framework = next((name for name in _LIGHTNING if name in names), None)
    if framework is None:
        return Decision("none", f"{shown} imports neither nodescale nor a framework that requeues itself")
    if scheduler != "slurm":
        return Decision("none", f"{shown} imports {framework}, which requeues a job on Slurm only")
    if mode != "per-gpu":
        return Decision("none", f"{shown} imports {framework}, which requeues itself only under --mode per-gpu "
                        "(one Slurm task per process)")
    return Decision("framework", f"{shown} imports {framework}")


def sentence(decision: Decision, warning_s: int, max_requeues: int) -> str:
    """The one line said at submission: what happens to this job at its wall time, and how to change it."""
    head = f"nodescale: stop handler {decision.handler} ({decision.why}): "
    if decision.handler == "nodescale":
        return (head + f"USR1 {warning_s} s before the wall time; the ranks checkpoint and the job is requeued "
                f"(at most {max_requeues} times, --max-requeues). Change with --stop-handler framework|none")
    if decision.handler == "framework":
        return (head + f"USR1 {warning_s} s before the wall time; the framework checkpoints and requeues the job "
                "itself, nodescale does not. Change with --stop-handler nodescale|none")
    return (head + "no stop signal: the job runs until its wall time ends it, and work since its last "
            "checkpoint is lost. To checkpoint and requeue: nodescale.preemption in the script (docs/launch.md) "
            "and --stop-handler nodescale")


def _is_nodescale_train(command: list[str]) -> bool:
    words = command[2:] if len(command) > 2 and command[1] == "-m" else command
    if words[:1] != ["nodescale"] and not (words[:1] and Path(words[0]).name == "nodescale"):
        return False
    # nodescale train, and a sweep member running it (nodescale sweep-member DIR -- nodescale train ...)
    return words[1:2] == ["train"] or (words[1:2] == ["sweep-member"] and "train" in words[2:])


def script_of(command: list[str], workdir: Path) -> Path | None:
    """The Python file ``command`` runs (``python [-u] x.py``, ``./x.py``, ``accelerate launch x.py``,
    ``python -m pkg.mod``), relative to ``workdir``; None when it runs none nodescale can find."""
    for index, word in enumerate(command):
        if index and command[index - 1] == "-m" and Path(command[0]).name.startswith("python"):
            found = _module_file(word, workdir)
            if found is not None:
                return found
        if word.endswith(".py"):
            path = Path(word) if Path(word).is_absolute() else workdir / word
            if path.is_file():
                return path
    return None


def _module_file(name: str, root: Path) -> Path | None:
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py", base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_names(script: Path, workdir: Path | None = None) -> set[str]:
    """The top-level names of every module ``script`` imports, and its own modules import: those in its
    folder or in ``workdir`` (where ``python x.py`` and ``python -m`` find them).

    Files are parsed, never run; a file too large, unreadable or not Python adds nothing.
    """
    roots = list(dict.fromkeys([script.parent, *([workdir] if workdir else [])]))
    names: set[str] = set()
    pending, seen = [script], set()
    while pending and len(seen) < MAX_FILES:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for dotted in _imports(path):
            names.add(dotted.split(".")[0])
            pending += [found for root in roots if (found := _module_file(dotted, root)) and found not in seen]
    return names


def _imports(path: Path) -> list[str]:
    """Each module ``path`` imports; ``from a import b`` also as ``a.b`` (b may be a module)."""
    try:
        if path.stat().st_size > MAX_SCRIPT_BYTES:
            return []
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")]
    return found
