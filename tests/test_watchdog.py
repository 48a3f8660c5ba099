"""The heartbeat watchdog: a rank that stops making progress ends the job, named, within the timeout."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import cli_env
from nodescale.distributed.watchdog import Watchdog, summarise_ranks
from nodescale.stop_signals import EXIT_HANG
from proc_tree import worker_of_rank
from test_preemption import last_step, wait_until


def pair(timeout: float) -> tuple[Watchdog, Watchdog, list[str]]:
    """Two ranks' watchdogs on one in-process store; what they report is collected, not exited on."""
    store = dist.HashStore()
    reports: list[str] = []
    dogs = [Watchdog(store, rank, 2, timeout, on_hang=reports.append, host=f"host{rank}") for rank in (0, 1)]
    return dogs[0], dogs[1], reports


def test_a_silent_rank_is_named_with_host_and_last_step() -> None:
    rank0, rank1, reports = pair(1.0)
    rank1.beat(7)
    rank1.start()
    rank1._stop.set()  # its thread ends: no heartbeat any more, as when the process is stopped
    rank0.start()
    try:
        assert wait_until(lambda: reports, 5), "no report"
    finally:
        rank0.stop()
    assert "rank 1 on host host1" in reports[0] and "last step 7" in reports[0]
    assert "stopped responding" in reports[0]


def test_a_live_rank_without_progress_is_named_but_pauses_are_not_hangs() -> None:
    rank0, rank1, reports = pair(1.0)
    rank1.beat(3)
    rank0.start()
    rank1.start()
    try:
        with rank1.paused():  # a long evaluation: no step, but not a hang
            time.sleep(2.0)
        assert not reports
        assert wait_until(lambda: reports, 5), "no report"
    finally:
        rank0.stop()
        rank1.stop()
    assert "rank 1 on host host1" in reports[0] and "last step 3" in reports[0]
    assert "made no progress" in reports[0] and "in wait_until" in reports[0]  # where its main thread is


def test_a_stuck_report_says_which_rank_the_others_wait_for() -> None:
    """Three live ranks, rank 2 a step behind: whichever watcher fires names rank 2 as the one behind."""
    store = dist.HashStore()
    reports: list[str] = []
    dogs = [Watchdog(store, rank, 3, 1.0, on_hang=reports.append, host=f"host{rank}") for rank in range(3)]
    for dog, step in zip(dogs, (5, 5, 4), strict=True):
        dog.beat(step)
        dog.start()
    try:
        assert wait_until(lambda: reports, 5), "no report"
    finally:
        for dog in dogs:
            dog.stop()
    assert "made no progress" in reports[0]
    assert "all ranks: rank 2 behind at step 4 (host host2, main thread at " in reports[0]
    assert "the other 2 at step 5;" in reports[0]


def _beat(step: int, where: str, host: str = "h0", state: str = "training") -> dict[str, object]:
    return {"count": 3, "step": step, "state": state, "host": host, "pid": 1, "idle_s": 99.0, "where": where}


def test_ranks_at_one_step_are_grouped_by_where_they_wait_smallest_group_first() -> None:
    beats = {rank: _beat(42, "c10d.py:10 in all_reduce") for rank in (0, 1, 2, 4, 5)}
    beats[3] = _beat(42, "c10d.py:20 in broadcast", host="h1")
    assert summarise_ranks(beats, 6) == ("every rank at step 42: rank 3 at c10d.py:20 in broadcast; "
                                         "ranks 0-2,4-5 at c10d.py:10 in all_reduce")
    # Past max_places the rest are counted, not listed.
    many = {rank: _beat(1, f"f.py:{rank} in g") for rank in range(6)}
    assert summarise_ranks(many, 6, max_places=2).endswith("rank 1 at f.py:1 in g; 4 more places")


def test_the_summary_names_ranks_behind_their_hosts_and_ranks_never_heard_from() -> None:
    beats = {0: _beat(9, "a.py:1 in f"), 1: _beat(7, "io.py:5 in read", host="h1"),
             2: _beat(7, "io.py:5 in read", host="h2"), 3: _beat(-1, "x", state="done"), 4: _beat(8, "a.py:1 in f")}
    assert summarise_ranks(beats, 7) == ("ranks 1-2 behind at step 7 (hosts h1, h2, main thread at io.py:5 in "
                                         "read), the other 2 at steps 8-9; no heartbeat from ranks 5-6")
    assert summarise_ranks({0: _beat(-1, "w.py:1 in init")}, 1) == "every rank at no step yet: rank 0 at w.py:1 in init"
    assert summarise_ranks({}, 2) == "no heartbeat from ranks 0-1"


def test_a_done_rank_is_not_reported() -> None:
    rank0, rank1, reports = pair(0.5)
    rank0.start()
    rank1.start()
    rank1.stop()
    time.sleep(1.5)
    rank0.stop()
    assert not reports


def stop_rank_1_of_a_long_run(tmp_path: Path, flags: list[str], settle_s: float, within_s: float,
                              fault: signal.Signals = signal.SIGSTOP, env: dict[str, str] | None = None
                              ) -> tuple[bool, float, str, int, subprocess.Popen[str]]:
    """Start a 2-rank run with ``flags``, send rank 1 ``fault`` (SIGSTOP) after step 10 (+ ``settle_s``), wait
    for rank 0 to leave.

    Returns (rank 0 left within ``within_s``, seconds until it did, the output, the stopped pid, the process).
    """
    process = subprocess.Popen(
        [sys.executable, "-m", "nodescale", "train", "--nproc", "2", "--epochs", "200", "--max-steps", "100000",
         "--log-every", "5", "--no-progress", "--out", "run", *flags],
        cwd=tmp_path, env=env or cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    stopped = None
    try:
        assert wait_until(lambda: last_step(tmp_path / "run") >= 10, 120), "no progress"
        time.sleep(settle_s)
        stopped = worker_of_rank(process.pid, 1)
        assert stopped is not None
        os.kill(stopped, fault)  # SIGSTOP, a real fault: the whole process, heartbeat thread included
        began = time.monotonic()
        # The launcher waits for the stopped rank after rank 0 left (SIGTERM does nothing to it,
        # SIGKILL comes after its grace period): once rank 0 is gone, the test ends the stopped one.
        gone = wait_until(lambda: worker_of_rank(process.pid, 0) is None, within_s)
        elapsed = time.monotonic() - began
        try:
            os.kill(stopped, signal.SIGKILL)
        except ProcessLookupError:  # its own watchdog ended it first
            pass
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return gone, elapsed, output, stopped, process


@pytest.mark.multiproc
def test_a_stopped_rank_ends_the_job_within_the_timeout(tmp_path: Path) -> None:
    timeout = 5
    # settle: a heartbeat (every timeout / 5 s) with a step in it has gone out
    gone, elapsed, output, stopped, process = stop_rank_1_of_a_long_run(
        tmp_path, ["--heartbeat-timeout", str(timeout)], settle_s=2.5, within_s=timeout + 30)
    assert gone and elapsed < timeout + 10, (elapsed, output)
    assert process.returncode != 0
    match = re.search(r"nodescale: hang: rank 1 on host (\S+) \(pid (\d+), last step (\d+)\) stopped responding",
                      output)
    assert match, output
    assert match.group(1) == socket.gethostname() and int(match.group(2)) == stopped
    # The step of its last heartbeat (published every second here): at most that far behind.
    assert 0 < int(match.group(3)) <= last_step(tmp_path / "run") + 5
    assert f"rank 0 exited with {EXIT_HANG}" in output or f"exit code {EXIT_HANG}" in output, output


# Installed in every process of the run through sitecustomize: on SIGWINCH the main thread blocks
# (a rank stuck in a read that never returns), while its other threads, the heartbeat's included, run on.
STUCK_ON_SIGWINCH = """
import signal, time
signal.signal(signal.SIGWINCH, lambda *_: time.sleep(3600))
"""


@pytest.mark.multiproc
def test_a_rank_stuck_but_alive_is_reported_with_every_ranks_place(tmp_path: Path) -> None:
    timeout = 4
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(STUCK_ON_SIGWINCH)
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(inject), env.get("PYTHONPATH")]))
    gone, elapsed, output, _, process = stop_rank_1_of_a_long_run(
        tmp_path, ["--heartbeat-timeout", str(timeout)], settle_s=0, within_s=timeout + 30,
        fault=signal.SIGWINCH, env=env)
    assert gone and elapsed < timeout + 15, (elapsed, output)
    lines = [line for line in (re.sub(r"^\[rank\d+\]: ", "", text) for text in output.splitlines())  # stderr: labelled
             if line.startswith("nodescale: hang: ")]
    # Both ranks' watchers may speak before the launcher ends the job (seen under load): each line must
    # say where rank 1 is stuck, as the neighbour or in the summary.
    assert 1 <= len(lines) <= 2, output
    for line in lines:
        assert "made no progress" in line and "; all ranks: " in line, line
        assert re.search(r"rank 1 .*sitecustomize\.py:\d+ in <lambda>", line), line
    assert process.returncode != 0 and str(EXIT_HANG) in output


@pytest.mark.multiproc
def test_without_the_watchdog_the_collective_timeout_ends_the_job_and_says_why(tmp_path: Path) -> None:
    timeout = 5
    gone, elapsed, output, _, _ = stop_rank_1_of_a_long_run(
        tmp_path, ["--heartbeat-timeout", "0", "--collective-timeout", str(timeout)], settle_s=0, within_s=timeout + 30)
    assert gone and timeout - 1 < elapsed < timeout + 15, (elapsed, output)
    assert re.search(rf"nodescale: hang: rank 0 on host \S+ at step \d+ waited longer than the collective timeout "
                     rf"\({timeout} s\)", output), output
    assert f"rank 0 exited with {EXIT_HANG}" in output and "Traceback" not in output, output


@pytest.mark.parametrize("message, kind", [
    ("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete",
     "timeout"),
    ("Application timeout caused pair closure", "timeout"),
    ("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242", "peer-gone"),
    ("[../gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:4242: Connection reset by peer", "peer-gone"),
    ("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)", None),
])
def test_collective_failures_caused_by_another_rank_are_recognised(message: str, kind: str | None) -> None:
    from nodescale.train.collective_faults import classify, explain

    assert classify(RuntimeError(message)) == kind
    assert classify(ValueError(message)) is None  # only the backends' RuntimeErrors
    fault = explain(RuntimeError(message), rank=3, step=17, timeout_s=600)
    assert (fault is None) == (kind is None)
    if fault is not None:
        assert "rank 3 on host" in fault.message and "step 17" in fault.message
        assert fault.exit_code == (EXIT_HANG if kind == "timeout" else 1)
