"""Ranks forked from one process that has imported torch already: one import per node, not one per rank.

A training worker spends most of its start-up importing: torch (2-3 s from a local disk, far
longer when 8 ranks read it from a parallel filesystem at once), ``torch._dynamo`` (which the
first optimizer imports) and DeepSpeed. For nodescale's own workers (``python -m MODULE``) the
launcher starts one *fork server* instead: it imports those modules once, then forks each rank,
which sets its torchrun variables and runs ``MODULE`` as ``python -m`` would.

Forking is safe there because nothing has run on a device yet. Should an import have touched
the GPU driver (torch then marks a forked child as a "bad fork"), that rank replaces itself
with a fresh ``python -m MODULE`` instead. Each rank gets a session of its own and dies with
the fork server, which dies with the launcher, so a launcher killed outright still stops every
rank. The server reports each rank's pid, then its exit status, a line each on a pipe; the
launcher polls, waits for and signals a rank through :class:`ForkedWorker` as it would a Popen.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from typing import NamedTuple, NoReturn

from nodescale.launch.schedulers.local_worker_group import die_with_parent, name_process
from nodescale.launch.schedulers.temp_files import remove_at_exit
from nodescale.launcher_death import PARENT_VARIABLE


class PythonModule(NamedTuple):
    """``python [FLAGS] -m MODULE ARGS``, split up."""

    interpreter: str
    flags: list[str]
    module: str
    args: list[str]


def as_python_module(command: Sequence[str]) -> PythonModule | None:
    """``command`` as a ``python -m MODULE`` call, or None when it is not one (only those are forked)."""
    if "-m" not in command[1:] or not os.path.basename(command[0]).startswith("python"):
        return None
    at = command.index("-m", 1)
    flags = list(command[1:at])
    if at + 1 >= len(command) or any(not flag.startswith("-") for flag in flags):
        return None
    return PythonModule(command[0], flags, command[at + 1], list(command[at + 2:]))


class ForkServer:
    """The launcher's side: the server process, and what its pipe has said so far."""

    def __init__(self, command: PythonModule, rank_envs: Sequence[Mapping[str, str]],
                 env: Mapping[str, str], preload: Sequence[str], output_fds: Sequence[int] = ()) -> None:
        read_end, write_end = os.pipe()
        spec = {"flags": command.flags, "module": command.module, "args": command.args, "preload": list(preload),
                "ranks": [dict(rank_env) for rank_env in rank_envs], "status_fd": write_end,
                "output_fds": list(output_fds)}  # each rank's stdout and stderr, where they are labelled
        # A file, not an argument: one argument holds at most 128 KiB, some 200 ranks' variables.
        handle, spec_path = tempfile.mkstemp(prefix="nodescale-fork-", suffix=".json")
        remove_at_exit(spec_path)  # the server removes it once read, unless the launcher dies first
        with os.fdopen(handle, "w") as spec_file:
            json.dump(spec, spec_file)
        try:
            self.process = subprocess.Popen(
                [command.interpreter, *command.flags, "-m", __name__, spec_path], env=dict(env),
                pass_fds=(write_end, *output_fds), start_new_session=True, preexec_fn=die_with_parent)
        except BaseException:
            os.unlink(spec_path)
            raise
        finally:
            os.close(write_end)
        self._pipe = read_end
        self._pending = b""
        self.workers = {rank: ForkedWorker(self) for rank in range(len(rank_envs))}

    def wait_until_started(self) -> None:
        """Block until every rank has a pid (or the server ended without forking them all)."""
        while any(worker.pid is None and worker.returncode is None for worker in self.workers.values()):
            self.read(None)

    def read(self, timeout: float | None) -> None:
        """Take in what the server has reported, waiting up to ``timeout`` seconds for something."""
        if self._pipe < 0 or not select.select([self._pipe], [], [], timeout)[0]:
            return
        data = os.read(self._pipe, 65536)
        if not data:
            self._server_ended()
            return
        *lines, self._pending = (self._pending + data).split(b"\n")
        for line in lines:
            event, rank, value = line.decode().split()
            worker = self.workers[int(rank)]
            if event == "started":
                worker.pid = int(value)
            else:
                worker.returncode = int(value)

    def _server_ended(self) -> None:
        """Ranks the server never reported on share its fate (they got its parent-death signal)."""
        os.close(self._pipe)
        self._pipe = -1
        code = self.process.wait()
        for worker in self.workers.values():
            if worker.returncode is None:
                worker.returncode = code or 1


class ForkedWorker:
    """One forked rank, polled, waited for and signalled like a ``subprocess.Popen``."""

    def __init__(self, server: ForkServer) -> None:
        self._server = server
        self.pid: int | None = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self._server.read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            self._server.read(left)
        return self.returncode


def serve(spec: Mapping[str, object]) -> int:
    """The fork server: import, fork each rank, report; in a rank, run its module and return its exit code."""
    status = os.fdopen(int(spec["status_fd"]), "w", buffering=1)  # type: ignore[call-overload]
    name_process("nodescale-fork")
    for name in spec["preload"]:  # type: ignore[attr-defined]
        importlib.import_module(name)
    gc.freeze()  # the imports' objects are never collected in a rank, so their pages stay shared
    ranks: dict[int, int] = {}
    server = os.getpid()
    for rank, rank_env in enumerate(spec["ranks"]):  # type: ignore[arg-type]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+ warns of native threads (BLAS, jemalloc)
            pid = os.fork()
        if pid == 0:
            status.close()
            _exit(_become_rank, rank_env, spec, server, rank)
        ranks[pid] = rank
        status.write(f"started {rank} {pid}\n")
    for fd in spec["output_fds"]:  # type: ignore[attr-defined]  # the ranks hold them: a rank's end ends its pipe
        os.close(fd)
    while ranks:
        pid, wait_status = os.wait()
        if pid in ranks:
            status.write(f"ended {ranks.pop(pid)} {os.waitstatus_to_exitcode(wait_status)}\n")
    return 0


def _become_rank(rank_env: Mapping[str, str], spec: Mapping[str, object], server: int, rank: int) -> int:
    """In the forked child: a session of its own, the rank's variables, then ``python -m MODULE``."""
    os.setsid()
    die_with_parent()
    if os.getppid() != server:  # the server died before the line above: no signal will come
        return 1
    outputs = list(spec["output_fds"])  # type: ignore[call-overload]
    if outputs:
        os.dup2(outputs[2 * rank], 1)  # local_rank_output.RankOutput.fds
        os.dup2(outputs[2 * rank + 1], 2)
        for fd in outputs:
            os.close(fd)
    os.environ.update(rank_env)
    os.environ[PARENT_VARIABLE] = str(server)  # the rank dies with the server, not with the launcher
    # /proc/PID/environ keeps the server's variables, without RANK: the name tells the ranks apart.
    name_process(f"nodescale-r{os.environ.get('RANK', '')}")
    module, args = str(spec["module"]), list(spec["args"])  # type: ignore[call-overload]
    if _in_bad_fork():
        os.execv(sys.executable, [sys.executable, *spec["flags"], "-m", module, *args])  # type: ignore[misc]
    return _run_module(module, args)


def run_module_and_exit(module: str, args: Sequence[str]) -> NoReturn:
    """In a forked process: ``python -m MODULE ARGS``, then its exit as python's (see ``_exit``)."""
    _exit(_run_module, module, list(args))


def _run_module(module: str, args: list[str]) -> int:
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0  # SystemExit and exceptions propagate to _exit, as under python -m


def _exit(run: Callable[..., int], *args: object) -> NoReturn:
    """End a rank as ``python -m`` would (exit code, traceback, threads, atexit), minus the interpreter's teardown.

    Tearing down frees every object the imports made, which in a forked process copies the
    pages it shares with the server: a second of CPU per rank, for nothing. multiprocessing's
    forked children end the same way, through the same two private calls.
    """
    interrupted = False
    try:
        code = run(*args)
    except SystemExit as end:
        code = _exit_code(end.code)
    except BaseException as error:  # noqa: BLE001 - reported as the interpreter would
        sys.excepthook(type(error), error, error.__traceback__)
        code, interrupted = 1, isinstance(error, KeyboardInterrupt)
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads finish first
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with suppress(Exception):
                stream.flush()
        if interrupted:  # python exits by SIGINT itself after an uncaught KeyboardInterrupt
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _exit_code(code: object) -> int:
    """``sys.exit(code)``'s exit status: None is 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _in_bad_fork() -> bool:
    """Whether an import touched a GPU driver before the fork (torch then refuses to use it in this child)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return any(getattr(torch._C, f"_{device}_isInBadFork", lambda: False)() for device in ("cuda", "xpu", "mtia"))


if __name__ == "__main__":
    with open(sys.argv[1]) as given:
        request = json.load(given)
    os.unlink(sys.argv[1])  # read once, by the server alone
    sys.exit(serve(request))
