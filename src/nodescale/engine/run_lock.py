"""One run at a time in a run directory: a lock file that names its holder (host, pid, job).

Why a file made exclusively, not ``flock``/``fcntl``: whether those locks are seen on other nodes
depends on the file system and how each client mounted it (Lustre: ``flock``, ``localflock`` or
``noflock``; NFS: its lock daemon), and a lock that silently locks nothing lets two runs in.
Creating a name is atomic on every POSIX file system, Lustre's and GPFS's included (their
metadata servers serialise it): the lock is written under a name of its own and hard-linked to
``.nodescale-lock``, which fails if that exists, so no reader sees half a lock (``O_EXCL`` where
links are not supported). The cost is a lock left behind by a killed run, hence the liveness rule:

- on this host, a holder whose process is gone (or whose pid is now another process, or which
  ran before a reboot) is stale, and is taken over with a warning;
- on another host, where no process can be seen, only a holder of the same scheduler job is
  stale: a requeued job, or its restarted step, follows its own earlier attempt. Any other is
  refused, naming the host, pid and job, with the lock file to delete once that run is surely gone.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import socket
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nodescale.distributed.launchers import scheduler_job_id
from nodescale.engine.file_errors import reported
from nodescale.errors import UserError

LOCK_NAME = ".nodescale-lock"
# Set by `nodescale train --nproc`'s launcher for its workers: "PID DIR", the lock it holds for them.
HELD_VARIABLE = "NODESCALE_RUN_DIR_HELD"


def another(flag: str) -> str:
    """The hint's way out: ``choose another --out`` (or ``out=`` of nodescale.init)."""
    return f"choose another {flag}" if flag.startswith("-") else f"choose another {flag} for nodescale.init"


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory's lock."""

    host: str
    pid: int
    job: str | None = None  # the scheduler's job id (Slurm, PBS) or torchrun's run id
    since: float = 0.0
    process_start: str | None = None  # /proc/PID/stat's start time: a reused pid is another process
    boot: str | None = None  # the kernel's boot id: after a reboot no process of before is alive

    def describe(self) -> str:
        """``pid 4242 on host n1, job 77, since 2025-01-31 12:00:00``."""
        job = f", job {self.job}" if self.job else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on host {self.host}{job}, since {since}"


def this_process() -> Holder:
    """The holder this process would be."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    job = scheduler_job_id(os.environ) or (run_id if run_id not in ("", "none") else None)
    return Holder(socket.gethostname(), os.getpid(), job, time.time(), _process_start(os.getpid()), _boot_id())


def _process_start(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22, counted after the command name


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def read_holder(lock: Path) -> Holder | None:
    """The lock's holder; None when there is no lock. A lock that cannot be read is a UserError."""
    try:
        data: Any = json.loads(lock.read_text())
        return Holder(str(data["host"]), int(data["pid"]), data.get("job"), float(data.get("since", 0.0)),
                      data.get("process_start"), data.get("boot"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"run directory lock {lock}", f"cannot be read ({exc})",
                        "if no run uses this directory, delete the lock file") from None


def why_stale(holder: Holder, me: Holder) -> str | None:
    """Why ``holder`` no longer holds the lock (its process is gone, ...); None while it may."""
    if holder.host != me.host:
        same_job = holder.job is not None and holder.job == me.job
        return f"an earlier attempt of job {holder.job}" if same_job else None
    if holder.boot and me.boot and holder.boot != me.boot:
        return "the host has rebooted since"
    if (holder.pid, holder.process_start) == (me.pid, me.process_start):
        return "an earlier run in this process that was not closed"
    if holder.pid <= 0:
        return "no such process"
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return "its process has ended"
    except PermissionError:  # another user's process: alive
        pass
    if holder.process_start and _process_start(holder.pid) not in (None, holder.process_start):
        return "its process has ended (the pid is another process now)"
    return None


class RunLock:
    """The lock on one run directory, held by this process (``owned``) or by its launcher for it."""

    def __init__(self, run_dir: Path, holder: Holder, owned: bool) -> None:
        self.path, self.holder, self.owned = run_dir / LOCK_NAME, holder, owned
        if owned:
            atexit.register(self.release)  # a script that never closes its context leaves no lock behind

    def release(self) -> None:
        """Remove the lock if it is still this process's (a forked child's exit leaves it alone)."""
        if not self.owned or os.getpid() != self.holder.pid:
            return
        self.owned = False
        atexit.unregister(self.release)
        try:
            if read_holder(self.path) == self.holder:
                self.path.unlink()
        except (OSError, UserError):  # gone already, or the file system with it: nothing left to free
            pass


def acquire(run_dir: Path, what: str, flag: str) -> RunLock:
    """Take ``run_dir``'s lock for this process: a UserError naming the holder while another run holds it.

    ``what`` names the directory as the user gave it (``--out 'x'``), ``flag`` the setting (``--out``).
    """
    lock, me = run_dir / LOCK_NAME, this_process()
    held = _held_by_launcher(run_dir, me)
    if held is not None:
        return RunLock(run_dir, held, owned=False)
    with reported(what, lock, another(flag)):
        for _ in range(3):  # a holder that leaves, or another run taking a stale lock over: look again
            if _create(lock, me):
                return RunLock(run_dir, me, owned=True)
            holder = read_holder(lock)
            if holder is None:
                continue
            reason = why_stale(holder, me)
            if reason is None:
                raise in_use(what, flag, lock, holder, me)
            if _take_over(lock, holder, me):
                if holder.pid != me.pid:
                    warnings.warn(f"{run_dir}: took over the lock of a run that ended without releasing it "
                                  f"({holder.describe()}: {reason})", stacklevel=2)
                return RunLock(run_dir, me, owned=True)
    holder = read_holder(lock)
    raise in_use(what, flag, lock, holder or me, me)


def in_use(what: str, flag: str, lock: Path, holder: Holder, me: Holder) -> UserError:
    """The error for a run directory another run holds."""
    if holder.host == me.host:
        hint = f"wait for that run to end (or stop it), or {another(flag)}"
    else:
        hint = (f"nodescale cannot see processes on {holder.host}: once that run is surely gone (its node failed), "
                f"delete {lock}; or {another(flag)}")
    return UserError(what, f"is in use by another run ({holder.describe()})", hint)


def peek(run_dir: Path, what: str, flag: str) -> None:
    """Refuse at once, without writing anything, a run directory another live run holds."""
    lock, me = run_dir / LOCK_NAME, this_process()
    holder = read_holder(lock)
    if holder is not None and why_stale(holder, me) is None and _held_by_launcher(run_dir, me) is None:
        raise in_use(what, flag, lock, holder, me)


def _held_by_launcher(run_dir: Path, me: Holder) -> Holder | None:
    """The launcher's lock, where this process is a worker it holds ``run_dir`` for."""
    pid, _, directory = os.environ.get(HELD_VARIABLE, "").partition(" ")
    if not pid.isdigit() or not directory or os.path.abspath(directory) != os.path.abspath(run_dir):
        return None
    holder = read_holder(run_dir / LOCK_NAME)
    return holder if holder is not None and (holder.host, holder.pid) == (me.host, int(pid)) else None


def _create(lock: Path, me: Holder) -> bool:
    """Write the lock whole under a name of our own, then link it into place; False if a lock is there."""
    text = json.dumps(asdict(me)) + "\n"
    own = lock.with_name(f"{LOCK_NAME}.{me.host}.{me.pid}")
    own.write_text(text)
    try:
        os.link(own, lock)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        return _create_exclusive(lock, text)  # a file system without hard links
    finally:
        own.unlink(missing_ok=True)


def _create_exclusive(lock: Path, text: str) -> bool:
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with open(fd, "w") as handle:
        handle.write(text)
    return True


def _take_over(lock: Path, stale: Holder, me: Holder) -> bool:
    """Replace the stale lock by ours; False when another run was quicker.

    The stale lock is renamed aside first: of several runs taking it over at once, one renames it, and
    one that renamed a fresh lock instead (taken over a moment before) puts it back.
    """
    aside = lock.with_name(f"{LOCK_NAME}.stale.{me.host}.{me.pid}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return False
    try:
        if read_holder(aside) != stale:
            try:
                os.link(aside, lock)
            except FileExistsError:
                pass
            return False
    finally:
        aside.unlink(missing_ok=True)
    return _create(lock, me)
