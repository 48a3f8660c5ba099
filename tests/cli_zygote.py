"""``nodescale ARGS`` in a real process of its own, forked from one that imported torch once per test worker.

Half of a short ``nodescale train`` run's CPU time is ``import torch`` and ``torch._dynamo``;
the suite starts some hundred such CLI processes. ``conftest.run_cli`` therefore asks a
*zygote*, started once per pytest process, to fork each one: the child gets its own pid,
session, working directory, environment, stdout and stderr files, and runs ``python -m
nodescale ARGS`` with the local fork server's exit (exit code, traceback, atexit), as a fresh
interpreter would. The zygote has imported modules only: it has run nothing on a device and no
parallel region, so its children may fork and compute freely.

Set ``NODESCALE_TEST_FRESH_CLI=1`` to start every CLI process afresh instead.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

ZYGOTE = r"""
import json, os, sys
import torch, torch._dynamo, nodescale.cli.main, nodescale.train.run  # what nearly every CLI run imports
import gc
from nodescale.launch.schedulers.local_fork_server import run_module_and_exit
from nodescale.launch.schedulers.local_worker_group import die_with_parent
gc.freeze()
requests, replies = os.fdopen(0, "r"), os.fdopen(int(sys.argv[1]), "w", buffering=1)
for line in requests:
    call = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            die_with_parent()
            for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, call["stdout"], os.O_WRONLY),
                                   (2, call["stderr"], os.O_WRONLY)):
                os.dup2(os.open(path, mode), fd)
            replies.close()
            os.chdir(call["cwd"])
            os.environ.clear()
            os.environ.update(call["env"])
        except BaseException:
            import traceback
            traceback.print_exc()
            os._exit(1)
        run_module_and_exit("nodescale", call["args"])
    replies.write(json.dumps({"pid": pid}) + "\n")
    replies.write(json.dumps({"code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}) + "\n")
"""

_lock = threading.Lock()
_zygote: tuple[subprocess.Popen[bytes], int] | None = None


def fresh_processes() -> bool:
    return os.environ.get("NODESCALE_TEST_FRESH_CLI") == "1"


def _start(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    from nodescale.launch.schedulers.local_worker_group import die_with_parent

    read_end, write_end = os.pipe()
    process = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(write_end)], stdin=subprocess.PIPE, env=env,
                               pass_fds=(write_end,), preexec_fn=die_with_parent)
    os.close(write_end)
    return process, read_end


def _reply(pipe: int, timeout: float | None) -> dict[str, int] | None:
    """The zygote's next line, or None after ``timeout`` seconds."""
    data = b""
    while not data.endswith(b"\n"):
        if not select.select([pipe], [], [], timeout)[0]:
            return None
        chunk = os.read(pipe, 4096)
        if not chunk:
            raise RuntimeError("the CLI zygote died")
        data += chunk
    return json.loads(data)


def run(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m nodescale ARGS`` forked from the zygote; like ``subprocess.run(..., capture_output=True)``."""
    global _zygote
    import tempfile

    with _lock, tempfile.TemporaryDirectory(prefix="cli-") as captured:
        if _zygote is None or _zygote[0].poll() is not None:
            _zygote = _start(env)
        process, pipe = _zygote
        out, err = Path(captured, "stdout"), Path(captured, "stderr")
        out.touch()
        err.touch()
        call = {"args": args, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        assert process.stdin is not None
        process.stdin.write((json.dumps(call) + "\n").encode())
        process.stdin.flush()
        pid = _reply(pipe, None)["pid"]  # type: ignore[index]
        ended = _reply(pipe, timeout)
        if ended is None:
            os.killpg(pid, signal.SIGKILL)
            _reply(pipe, None)
            raise subprocess.TimeoutExpired(["nodescale", *args], timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(["nodescale", *args], ended["code"], out.read_text(), err.read_text())
