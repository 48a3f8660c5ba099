"""A start-up blocked in the user's code: a launcher killed outright takes its ranks and temporary files
with it, and the collective timeout ends it with the hang report, as it does a blocked step.

Real runs: rank 1 sleeps in the user's model function (or script) while rank 0 waits in a gloo
collective, where no Python signal handler runs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env
from nodescale.launcher_death import POLL_SECONDS
from nodescale.stop_signals import EXIT_HANG
from proc_tree import descendants, worker_of_rank
from test_preemption import wait_until
from test_worker_group import _alive, _launcher

# The ranks look for their launcher every POLL_SECONDS; the rest is room for a loaded machine. Before,
# they lived until the collective timeout (600 s by default).
GONE_WITHIN_S = 20 + 10 * POLL_SECONDS

SLEEPS_ON_RANK_1 = """
import os, time
from torch import nn

def build():
    if os.environ["RANK"] == "1":
        open(f"asleep-{os.getpid()}", "w").close()
        time.sleep(3600)  # rank 0 meanwhile waits in DDP's first collective
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
"""


def _start_blocked(tmp_path: Path, flags: list[str]) -> subprocess.Popen[bytes]:
    """``nodescale train`` with rank 1 asleep in the model function; its output goes to ``output.txt``."""
    (tmp_path / "blocked.py").write_text(SLEEPS_ON_RANK_1)
    env = cli_env()
    env["TMPDIR"] = str(tmp_path / "tmp")  # the launcher's temporary files, apart from other runs'
    (tmp_path / "tmp").mkdir()
    with (tmp_path / "output.txt").open("wb") as output:  # a file: no pipe for a surviving rank to hold open
        process = subprocess.Popen(
            [sys.executable, "-m", "nodescale", "train", "--nproc", "2", "--model", "blocked.py:build",
             "--max-steps", "5", "--no-progress", "--out", "run", *flags],
            cwd=tmp_path, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    assert wait_until(lambda: list(tmp_path.glob("asleep-*")), 120), (tmp_path / "output.txt").read_text()
    return process


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _launcher_files(tmp_path: Path) -> list[str]:
    return [path.name for path in (tmp_path / "tmp").iterdir() if path.name.startswith("nodescale-")]


@pytest.mark.multiproc
def test_a_killed_launcher_takes_its_blocked_ranks_and_temporary_files_with_it(tmp_path: Path) -> None:
    process = _start_blocked(tmp_path, [])
    helpers = descendants(process.pid)  # the fork server, both ranks, the temporary files' helper
    try:
        ranks = [worker_of_rank(process.pid, rank) for rank in (0, 1)]
        assert None not in ranks and _launcher_files(tmp_path), (ranks, _launcher_files(tmp_path))
        process.kill()  # kill -9: the launcher passes nothing on
        process.wait()
        gone = wait_until(lambda: not any(_alive(pid) for pid in helpers), GONE_WITHIN_S)
        assert gone, [pid for pid in helpers if _alive(pid)]
        assert wait_until(lambda: not _launcher_files(tmp_path), GONE_WITHIN_S), _launcher_files(tmp_path)
    finally:
        _kill_all(helpers)


@pytest.mark.multiproc
def test_a_start_up_block_ends_with_the_hang_report(tmp_path: Path) -> None:
    timeout = 5
    process = _start_blocked(tmp_path, ["--collective-timeout", str(timeout)])
    helpers = descendants(process.pid)
    try:
        asleep = worker_of_rank(process.pid, 1)
        # Rank 0 leaves once its collective times out; rank 1, asleep, would get the launcher's 30 s grace.
        assert wait_until(lambda: worker_of_rank(process.pid, 0) is None, timeout + 60), "rank 0 did not leave"
        _kill_all([asleep] if asleep else [])
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        _kill_all(helpers)
    output = (tmp_path / "output.txt").read_text()
    assert re.search(rf"nodescale: hang: rank 0 on host \S+ at step 0 waited longer than the collective timeout "
                     rf"\({timeout} s\)", output), output
    assert f"rank 0 exited with {EXIT_HANG}" in output and "Traceback" not in output, output


# A user's script under the local launcher, started afresh (not forked), with nodescale.preemption's
# handlers. Both ranks block in native code, where Python runs no signal handler until the call returns.
SCRIPT_BLOCKED_ON_RANK_1 = """
    import os
    from datetime import timedelta
    import torch.distributed as dist
    import nodescale.preemption as preemption

    dist.init_process_group("gloo")
    preemption.requested()  # the stop handlers now catch SIGTERM, the launcher's death signal
    if os.environ["RANK"] == "1":  # waits for a key nobody sets, in the store's C++ client
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(hours=1))
        open(f"pid-{os.getpid()}", "w").close()
        store.wait(["never"])
    else:  # waits in gloo for rank 1
        pending = dist.barrier(async_op=True)
        open(f"pid-{os.getpid()}", "w").close()
        pending.wait()
"""


@pytest.mark.multiproc
def test_a_scripts_ranks_blocked_in_native_code_do_not_outlive_a_killed_launcher(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, SCRIPT_BLOCKED_ON_RANK_1, preload=())
    try:
        assert wait_until(lambda: len(list(tmp_path.glob("pid-*"))) == 2, 120), "the ranks did not start"
        pids = [int(path.name.split("-")[1]) for path in tmp_path.glob("pid-*")]
        launcher.kill()
        launcher.wait()  # not its output: the ranks share its pipes
        assert wait_until(lambda: not any(_alive(pid) for pid in pids), GONE_WITHIN_S)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        _kill_all([int(path.name.split("-")[1]) for path in tmp_path.glob("pid-*")])
        launcher.communicate()
