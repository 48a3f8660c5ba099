"""The run directory is owned (issue 36, class 4): nodescale's own or empty, one run at a time, errors named.

* Paths that cannot be a run directory (a file in the way, a 300-character name, a read-only
  file system, ``--out ''``) are refused naming the path and the cause, exit 2, no traceback.
* A directory of someone else's files is refused and left as it was; older runs without the
  marker are still recognised by their files.
* A second run on a directory another run holds is refused naming that run's host and pid; a
  lock whose process is gone is taken over with a warning (the rules: nodescale/engine/run_lock.py).
* A full disk while writing metrics is a UserError naming the file.
* ``ranks.log`` keeps every launch, each headed, and the failure summary reads the last.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import nodescale
from conftest import cli_env, read_summary, run_cli
from nodescale.engine import run_lock
from nodescale.engine.metrics_log import MetricsLog
from nodescale.engine.run_dir import MARKER, check_run_dir, claim, is_nodescale_run
from nodescale.engine.run_lock import LOCK_NAME, Holder, why_stale
from nodescale.errors import UserError
from nodescale.launch.first_failure import summary_of_logs
from nodescale.launch.schedulers.local_rank_output import note, open_log
from test_hostile_input import run_main

# The launcher's path: every check and the claim happen before a worker starts, in this process.
TRAIN = ["train", "--nproc", "2", "--max-steps", "1", "--no-progress"]
ONE = ["train", "--strategy", "single", "--max-steps", "2", "--no-progress"]


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A read-only tmpfs, mounted for this test only (root can write anywhere a mode forbids it)."""
    mount = tmp_path / "ro"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        message = f"cannot mount a tmpfs here ({result.stderr.strip()}): the read-only test needs root"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize(("out", "rule"), [
    ("afile/sub", "cannot be made: 'afile' is a file, not a directory"),
    ("x" * 300, "cannot be used: a name in the path is too long for the file system"),
    ("", "names no directory"),
], ids=["a-file-in-the-way", "a-300-character-name", "empty"])
def test_a_path_that_cannot_be_a_run_directory_is_named_with_its_cause(
        out: str, rule: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative --out, and '' would be the current directory
    (tmp_path / "afile").write_text("mine")
    code, _, stderr = run_main([*TRAIN, "--out", out])
    assert code == 2, stderr
    assert f"--out {out!r}: {rule}" in stderr and "hint:" in stderr and "Traceback" not in stderr
    assert sorted(os.listdir(tmp_path)) == ["afile"]
    with pytest.raises(UserError, match="names no directory" if not out else "nodescale.init"):
        nodescale.init(out=out)


def test_a_read_only_file_system_is_named_on_either_path(read_only_dir: Path, tmp_path: Path) -> None:
    out = str(read_only_dir / "run")
    code, _, stderr = run_main([*TRAIN, "--out", out])  # the launcher's claim
    assert code == 2 and f"--out {out!r}: cannot be written: the file system is read-only" in stderr, stderr
    one = run_cli([*ONE, "--out", out], cwd=tmp_path, check=False)  # rank 0's claim, no launcher
    assert one.returncode == 2 and "the file system is read-only" in one.stderr, one.stderr
    assert "Traceback" not in stderr + one.stderr and one.stderr.count("nodescale: error") == 1


def test_someone_elses_directory_is_refused_and_left_as_it_was(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.yaml").write_text("their: settings\n")
    (theirs / "metrics.csv").write_text("step,loss\n1,0.5\n")
    before = {path.name: path.read_text() for path in theirs.iterdir()}
    for flags in ([], ["--resume"]):
        code, _, stderr = run_main([*TRAIN, *flags, "--out", str(theirs)])
        assert code == 2, stderr
        assert "holds files that are not a nodescale run's (config.yaml, metrics.csv)" in stderr, stderr
    with pytest.raises(UserError, match="not a nodescale run's"):
        nodescale.init(out=theirs)
    monkeypatch.chdir(theirs)
    code, _, stderr = run_main([*TRAIN, "--out", "."])
    assert code == 2 and "--out '.': holds files" in stderr, stderr
    assert {path.name: path.read_text() for path in theirs.iterdir()} == before


def test_older_runs_are_recognised_by_their_files_and_a_new_run_is_marked_first(tmp_path: Path) -> None:
    layouts = {"checkpoints": "checkpoints/step-00000020.pt", "metrics": "metrics.jsonl", "summary": "summary.json",
               "launch": "ranks.log"}
    for name, path in layouts.items():
        (tmp_path / name / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name / path).write_text("nodescale: the local launcher places 2 task(s) on each host\n")
        assert is_nodescale_run(tmp_path / name), name
        check_run_dir(tmp_path / name, resume=True)
    (tmp_path / "log" / "ranks.log").parent.mkdir()
    (tmp_path / "log" / "ranks.log").write_text("my own log\n")
    assert not is_nodescale_run(tmp_path / "log")
    (tmp_path / "empty").mkdir()
    lock = claim(tmp_path / "empty", resume=False)
    assert sorted(os.listdir(tmp_path / "empty")) == sorted([MARKER, LOCK_NAME])  # before any file of the run
    lock.release()
    assert os.listdir(tmp_path / "empty") == [MARKER]
    claim(tmp_path / "empty", resume=False).release()  # marked, with no run in it yet: still free
    claim(tmp_path / "new" / "run", resume=False).release()
    assert stat.S_IMODE((tmp_path / "new" / "run").stat().st_mode) & 0o027 == 0  # a job directory's 0750


HOLD = """import sys
from pathlib import Path
from nodescale.engine.run_dir import claim
claim(Path(sys.argv[1]), resume=False)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_second_run_is_refused_naming_the_first_and_a_dead_ones_lock_is_taken_over(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], env=cli_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        who = f"is in use by another run (pid {holder.pid} on host {socket.gethostname()}, since "
        code, _, stderr = run_main([*TRAIN, "--resume", "--out", str(run)])
        assert code == 2 and f"--out {str(run)!r}: {who}" in stderr and "Traceback" not in stderr, stderr
        with pytest.raises(UserError, match=f"pid {holder.pid} on host"):
            nodescale.init(out=run)
    finally:
        holder.kill()  # no chance to release: the lock stays behind
        holder.wait()
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == holder.pid
    taken = run_cli([*ONE, "--out", str(run)], cwd=tmp_path)
    assert f"took over the lock of a run that ended without releasing it (pid {holder.pid}" in taken.stderr
    assert read_summary(run)["global_steps"] == 2 and not (run / LOCK_NAME).exists()  # released at the end


def test_a_run_holds_its_directory_while_it_trains(tmp_path: Path) -> None:
    """A real 2-rank run: its launcher holds the lock for its workers, a second run is refused until it ends."""
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "nodescale", "train", "--nproc", "2", "--max-steps", "100000",
                              "--no-progress", "--out", str(run)], cwd=tmp_path, env=cli_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (run / "config.yaml").exists():  # rank 0 writes it once training is about to begin
            assert first.poll() is None, first.communicate()
            time.sleep(0.05)
        config = (run / "config.yaml").read_text()
        code, _, stderr = run_main([*TRAIN, "--lr", "0.5", "--resume", "--out", str(run)])
        assert code == 2 and f"in use by another run (pid {first.pid} on host" in stderr, stderr
        assert (run / "config.yaml").read_text() == config
    finally:
        first.send_signal(signal.SIGTERM)  # a stop: every worker checkpoints, the launcher lets go
        _, first_err = first.communicate(timeout=180)
    assert first.returncode == 128 + signal.SIGTERM, first_err[-2000:]
    assert not (run / LOCK_NAME).exists()


def test_stale_and_live_holders(tmp_path: Path) -> None:
    me = run_lock.this_process()
    ended = subprocess.Popen(["true"])
    ended.wait()
    assert why_stale(dataclasses.replace(me, pid=ended.pid), me) == "its process has ended"
    parent = dataclasses.replace(me, pid=os.getppid(), process_start=run_lock._process_start(os.getppid()))
    assert why_stale(parent, me) is None
    assert "another process now" in why_stale(dataclasses.replace(parent, process_start="1"), me)
    assert why_stale(dataclasses.replace(parent, boot="an earlier boot"), me) == "the host has rebooted since"
    elsewhere = Holder("node7", 1234, "4242")
    assert why_stale(elsewhere, dataclasses.replace(me, job=None)) is None  # cannot be seen from here
    assert why_stale(elsewhere, dataclasses.replace(me, job="4243")) is None
    assert why_stale(elsewhere, dataclasses.replace(me, job="4242")) == "an earlier attempt of job 4242"


def test_a_full_disk_while_writing_metrics_is_named(tmp_path: Path) -> None:
    """/dev/full: the kernel's ENOSPC on every write, as a full file system gives it."""
    log = MetricsLog(Path("/dev/full"), enabled=True)
    with pytest.raises(UserError, match="metrics file /dev/full: cannot be written: no space left on device"):
        log.write({"kind": "step", "step": 1})
    log.close()  # nothing buffered is written again
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to("/dev/full")
    result = run_cli([*ONE, "--resume", "--out", "run"], cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "metrics file run/metrics.jsonl: cannot be written: no space left on device" in result.stderr
    assert "Traceback" not in result.stderr and not (run / LOCK_NAME).exists()


def test_ranks_log_keeps_every_launch_and_the_summary_reads_the_last(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = open_log(tmp_path, 2)
        note(first, "[rank1]: RuntimeError: the crash that caused the resume")
        first.close()
        resumed = open_log(tmp_path, 2)
        note(resumed, "[rank0]: OSError: the resumed run's own failure")
        resumed.close()
    lines = (tmp_path / "ranks.log").read_text().splitlines()
    assert "[rank1]: RuntimeError: the crash that caused the resume" in lines
    assert sum(line.startswith("nodescale: launch at ") for line in lines) == 2
    summary = summary_of_logs([tmp_path / "ranks.log"], str(tmp_path))
    assert summary[-1].startswith(f"nodescale: the job failed: rank 0 on {socket.gethostname()} failed first")
    assert "the crash that caused the resume" not in "\n".join(summary)
