"""A sweep on disk: what was asked (``SWEEP_DIR/sweep.json``) and how each member ended.

``sweep.json`` is written once at submission and again at each resubmission (atomically); the
job script of member ``I`` writes ``SWEEP_DIR/status/I`` (its exit code) when its step ends for
good, not when it stops for a requeue. ``nodescale jobs``, ``report`` and ``launch
--resubmit-failed`` read only these files and the scheduler's queue, so a sweep's state
survives the scheduler forgetting its jobs (there may be no ``sacct``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nodescale.atomic_files import write_json_atomic
from nodescale.errors import UserError

MANIFEST = "sweep.json"
STATUS_DIR = "status"
VERSION = 1


@dataclass(frozen=True)
class Member:
    index: int
    settings: dict[str, Any]  # swept key (a config key for nodescale train, else as given) -> this member's value
    run_dir: str  # absolute; `nodescale train` writes its summary.json here


@dataclass(frozen=True)
class Submission:
    job_id: str  # the array's id (Slurm's %A, PBS's 123[].server); "local" for members run here
    scheduler: str
    members: list[int]  # member indices this submission runs
    resume: bool  # a --resubmit-failed submission: the members resume from their checkpoints
    log: str  # the members' log path, with {index} where the member's index goes
    submitted_at: float


@dataclass
class Sweep:
    name: str
    directory: Path
    command: list[str]  # the command as given after --, before any member's settings
    launch_argv: list[str]  # launch's own flags, as given (without the command), for --resubmit-failed
    keys: list[str]
    members: list[Member]
    submissions: list[Submission] = field(default_factory=list)
    workdir: str = ""  # where launch ran: --resubmit-failed reads launch_argv's relative paths from there

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["directory"] = str(self.directory)
        return {"version": VERSION, **data}


def write(sweep: Sweep) -> Path:
    """Create or replace ``sweep.json`` in the sweep's directory; its path."""
    path = sweep.directory / MANIFEST
    write_json_atomic(path, sweep.to_json())
    return path


def is_sweep(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def read(directory: Path) -> Sweep:
    """The sweep recorded in ``directory``; UserError when there is none or it cannot be read."""
    path = directory / MANIFEST
    try:
        data = json.loads(path.read_text())
        return Sweep(
            name=data["name"], directory=Path(data["directory"]), command=list(data["command"]),
            launch_argv=list(data["launch_argv"]),
            keys=list(data["keys"]), members=[Member(**member) for member in data["members"]],
            submissions=[Submission(**sub) for sub in data.get("submissions", [])],
            workdir=str(data.get("workdir", "")),
        )
    except FileNotFoundError:
        raise UserError(str(directory), f"holds no {MANIFEST}, so it is not a sweep's directory",
                        "give the directory `nodescale launch --sweep` printed") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(str(path), f"cannot be read as a sweep record ({exc})",
                        "it is written by `nodescale launch --sweep`; do not edit it") from None


def status_path(directory: Path, index: int) -> Path:
    return directory / STATUS_DIR / str(index)


def exit_code(directory: Path, index: int) -> int | None:
    """The member's recorded exit code, or None while it has none (queued, running, or killed unrecorded)."""
    try:
        return int(status_path(directory, index).read_text().strip())
    except (OSError, ValueError):
        return None


def member_state(sweep: Sweep, member: Member) -> str:
    """``done`` or ``failed``, from the member's files, for a member the scheduler no longer lists as queued or
    running (:mod:`nodescale.launch.sweep_state` asks it first). Neither an exit code nor a summary: it ended
    without saying how (killed with its node, cancelled): ``failed``."""
    code = exit_code(sweep.directory, member.index)
    if code is not None:
        return "done" if code == 0 else "failed"
    return "done" if (Path(member.run_dir) / "summary.json").is_file() else "failed"
