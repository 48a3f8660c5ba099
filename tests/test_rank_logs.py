"""Per-rank logs: the labels the job scripts put on every line, ``nodescale logs``, and the
failure summary that ends a failed job's log (issue 15, item 1).

The parsing and the choice of the first failed rank are pure functions, tested on log text as
srun, torchrun, MPICH and Open MPI print it. One real 2-node Slurm job (torchrun mode, rank 1
on node2 raises) checks the whole path: its log's last lines, ``--rank 1``, ``--follow``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import run_cli
from nodescale.errors import UserError
from nodescale.launch.first_failure import first_failure, placed_hosts, summary, summary_of_logs
from nodescale.launch.rank_logs import Line, line_filter, parse, parse_line
from scheduler_fixtures import SlurmCluster, search_path
from test_launch_schedulers import isolated, launch_slurm, slurm, submitted  # noqa: F401 (fixtures)

# A 2-node torchrun job as srun --label and torchrun --tee 3 print it (torch 2.13, trimmed):
# rank 1 raised, rank 0 then lost its peer and printed the longer traceback.
TORCHRUN_LOG = """\
nodescale: rendezvous at 127.0.0.1:17269
0: [rank0]:hello from rank 0
1: [rank1]:hello from rank 1
1: [rank1]:[rank1]: Traceback (most recent call last):
1: [rank1]:[rank1]:   File "/tmp/lg/fail.py", line 9, in <module>
1: [rank1]:[rank1]: RuntimeError: rank one broke on purpose
0: [rank0]:[rank0]: Traceback (most recent call last):
0: [rank0]:[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:18819.
0: E1126 18:31:28.584000 24485 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 24596) of binary: python
0: Root Cause (first observed failure):
0: [0]:
0:   time      : 2026-11-26_18:31:28
0:   host      : localhost
0:   rank      : 0 (local_rank: 0)
0:   exitcode  : 1 (pid: 24596)
0:   error_file: <N/A>
1: Root Cause (first observed failure):
1: [0]:
1:   time      : 2026-11-26_18:31:28
1:   host      : localhost
1:   rank      : 1 (local_rank: 0)
1:   exitcode  : 1 (pid: 24597)
1:   error_file: <N/A>
srun: error: node2: task 1: Exited with exit code 1
srun: error: node1: task 0: Terminated
"""


def fields(line: Line) -> tuple[int | None, int | None, str]:
    return line.rank, line.node, line.text


def test_labels_of_every_launcher_are_read() -> None:
    assert fields(parse_line("1: text", False)) == (1, None, "text")  # srun --label, PALS --label
    assert fields(parse_line(" 12: text", False)) == (12, None, "text")  # srun pads to the widest task id
    assert fields(parse_line("[3] text", False)) == (3, None, "text")  # MPICH -prepend-rank
    assert fields(parse_line("[1,5]<stderr>:text", False)) == (5, None, "text")  # Open MPI --tag-output
    assert fields(parse_line("1: [rank3]:text", True)) == (3, 1, "text")  # torchrun mode: node 1's rank 3
    assert parse_line("1: [rank3]:[rank3]: Traceback", True).text == "Traceback"  # torch's own prefix once
    assert fields(parse_line("1: torchrun's agent", True)) == (None, 1, "torchrun's agent")  # a node, not rank 1
    assert fields(parse_line("nodescale: rendezvous", False)) == (None, None, "nodescale: rendezvous")


def test_torchrun_mode_is_told_from_the_labels() -> None:
    lines = parse(TORCHRUN_LOG.splitlines())
    assert [line.text for line in lines if line.rank == 1] == [
        "hello from rank 1", "Traceback (most recent call last):", '  File "/tmp/lg/fail.py", line 9, in <module>',
        "RuntimeError: rank one broke on purpose"]


def test_first_failure_is_the_rank_that_raised_not_the_one_that_lost_its_peer() -> None:
    lines = parse(TORCHRUN_LOG.splitlines())
    failure = first_failure(lines)
    assert failure is not None and (failure.rank, failure.host, failure.code) == (1, "node2", 1)
    text = summary(lines, "2269")
    assert text[-1] == ("nodescale: the job failed: rank 1 on node2 failed first, exit code 1; its last lines are "
                        "above; all of them: `nodescale logs 2269 --rank 1`")
    assert text[-2] == "nodescale: | RuntimeError: rank one broke on purpose"
    # Rank 0's traceback printed first (the order of the logs is not the order of failure): the time decides.
    swapped = TORCHRUN_LOG.replace("2026-11-26_18:31:28\n0:   host", "2026-11-26_18:31:29\n0:   host")
    assert first_failure(parse(swapped.splitlines())).rank == 1


def test_per_gpu_mode_reads_srun_and_prefers_a_killed_rank() -> None:
    log = textwrap.dedent("""\
        0: step 1
        1: step 1
        0: RuntimeError: Connection reset by peer
        srun: error: node1: task 0: Exited with exit code 1
        srun: error: node2: tasks 1-2: Killed
        srun: error: node3: task 3: Terminated
    """).splitlines()
    failure = first_failure(parse(log))
    # Rank 1 was killed by a signal (the OOM killer, say); rank 0 exited 1 after losing it.
    assert failure is not None and (failure.rank, failure.host, failure.code) == (1, "node2", -9)


def test_without_a_launcher_report_the_first_traceback_wins() -> None:
    log = ["[0] step 3", "[1] Traceback (most recent call last):", "[1] OSError: [Errno 28] No space left",
           "[0] Traceback (most recent call last):", "[0] RuntimeError: Connection closed by peer"]
    text = summary(parse(log), "77.pbs")
    assert text[-1].startswith("nodescale: the job failed: rank 1 on an unknown host failed first;"), text
    assert summary(parse(["0: all fine"]), "5")[-1].startswith("nodescale: the job failed; no rank's failure")


def test_filters_by_rank_and_regex_and_refuse_a_bad_regex() -> None:
    lines = parse(TORCHRUN_LOG.splitlines())
    keep = line_filter(1, "Error")
    assert [line.text for line in lines if keep(line)] == ["RuntimeError: rank one broke on purpose"]
    with pytest.raises(UserError, match="is not a regular expression"):
        line_filter(None, "([")


def test_logs_command_on_a_log_file(tmp_path: Path) -> None:
    (tmp_path / "slurm-2269.out").write_text(TORCHRUN_LOG)
    shown = run_cli(["logs", str(tmp_path), "--rank", "0"], cwd=tmp_path).stdout.splitlines()
    assert shown[0] == "hello from rank 0" and not any("rank 1" in line for line in shown), shown
    grep = run_cli(["logs", str(tmp_path / "slurm-2269.out"), "--grep", "^srun"], cwd=tmp_path).stdout
    assert grep.splitlines() == TORCHRUN_LOG.splitlines()[-2:]
    for bad, message in ((["--grep", "(x"], "is not a regular expression"), (["--rank", "-1"], "is not a rank")):
        result = run_cli(["logs", str(tmp_path), *bad], cwd=tmp_path, check=False)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    missing = run_cli(["logs", "424242"], cwd=tmp_path, check=False)
    assert missing.returncode == 2 and "nodescale jobs --all" in missing.stderr


FAILING = """\
import os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
node = os.environ["SLURMD_NODENAME"]
print(f"hello from rank {dist.get_rank()} on {node}", flush=True)
dist.barrier()
if node == "node2":
    raise RuntimeError(f"rank {dist.get_rank()} broke on purpose")
dist.all_reduce(torch.zeros(1))  # the other rank loses its peer here
"""


@pytest.mark.slow
def test_failed_slurm_job_names_its_first_failed_rank(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    """torchrun mode, the rank on node2 raises. (torchrun's rendezvous decides which rank that is.)"""
    (tmp_path / "fail.py").write_text(FAILING)
    result = launch_slurm(tmp_path, "--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "1",
                          command=[sys.executable, "fail.py"])
    job_id, _, log = submitted(result.stdout)
    # --follow from submission: it prints the lines as they come and returns when the job has ended.
    followed = run_cli(["logs", job_id, "--follow"], cwd=tmp_path, timeout=180).stdout
    assert slurm.wait_until_done(job_id, 30) == "FAILED"
    output = log.read_text()
    # Both files as they grew: the .out's lines in their order, srun's .err lines wherever a poll found them.
    err = log.with_suffix(".err")
    shown, errors = followed.splitlines(), err.read_text().splitlines() if err.exists() else []
    assert sorted(shown) == sorted(output.splitlines() + errors), followed
    assert [line for line in shown if line not in errors] == [line for line in output.splitlines()
                                                              if line not in errors], followed
    bad = re.search(r"^\d+: \[rank(\d)\]:hello from rank \1 on node2$", output, re.M)
    assert bad, output
    rank, other = int(bad[1]), 1 - int(bad[1])
    last = output.splitlines()
    assert last[-1].startswith(f"nodescale: the job failed: rank {rank} on node2 failed first, exit code 1;"), last
    # torchrun relays a rank's stdout and stderr from two files: their lines may swap, not leave.
    assert f"nodescale: | RuntimeError: rank {rank} broke on purpose" in last[-8:-1], last

    own = run_cli(["logs", job_id, "--rank", str(rank)], cwd=tmp_path).stdout.splitlines()
    assert f"hello from rank {rank} on node2" in own and f"RuntimeError: rank {rank} broke on purpose" in own, own
    assert not any(f"rank {other}" in line or "Connection closed" in line for line in own), own
    grep = run_cli(["logs", job_id, "--grep", "^hello"], cwd=tmp_path).stdout.splitlines()
    assert len(grep) == 2 and all(re.match(r"\d: \[rank\d\]:hello from rank", line) for line in grep), grep
    failure = run_cli(["logs", job_id, "--failure"], cwd=tmp_path).stdout.splitlines()
    assert failure == last[-len(failure):]


def test_first_failure_module_runs_without_the_cli(tmp_path: Path) -> None:
    """What the job scripts call: ``python3 -m nodescale.launch.first_failure JOB LOG...``."""
    (tmp_path / "a.out").write_text(TORCHRUN_LOG)
    out = subprocess.run([sys.executable, "-m", "nodescale.launch.first_failure", "9", str(tmp_path / "a.out"),
                          str(tmp_path / "missing.err")], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1].startswith("nodescale: the job failed: rank 1 on node2")


def test_a_restarted_job_is_summarised_from_its_last_attempt(tmp_path: Path) -> None:
    """Each log file from its last restart line on: the Slurm loop writes that line to the .err file too."""
    out, err = tmp_path / "slurm-7.out", tmp_path / "slurm-7.err"
    out.write_text("0: OSError: first attempt\nnodescale: restart 1 of 1: the ranks resume\n0: fine\n"
                   "1: RuntimeError: second attempt\n")
    err.write_text("srun: error: node1: task 0: Exited with exit code 1\nnodescale: restart 1 of 1\n"
                   "srun: error: node2: task 1: Exited with exit code 1\n")
    text = summary_of_logs([out, err], "7")
    assert text[-1].startswith("nodescale: the job failed: rank 1 on node2 failed first, exit code 1"), text
    assert "first attempt" not in "\n".join(text)
    # PBS: the script's placement line names each task's host; it comes before any restart.
    placed = ["nodescale: mpiexec places 2 task(s) on each host, in this order: h1 h2",
              "[3] Traceback (most recent call last):"]
    assert summary(parse(placed), "8.pbs", placed_hosts(placed))[-1].startswith(
        "nodescale: the job failed: rank 3 on h2 failed first;")


# The failing rank waits for the other's hello (a marker file): else, on a loaded machine, the launcher stops
# the other rank before it has said anything.
LOCAL_FAIL_EACH_TIME = """\
import os, pathlib, time
attempt, rank = os.environ.get("NODESCALE_RESTART_COUNT", "0"), os.environ["RANK"]
print(f"hello from rank {rank}, attempt {attempt}", flush=True)
pathlib.Path(f"said-{attempt}-{rank}").touch()
if rank == attempt:
    other = pathlib.Path(f"said-{attempt}-{1 - int(rank)}")
    deadline = time.monotonic() + 60
    while not other.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
assert rank != attempt, f"attempt {attempt} broke on rank {rank}"
"""


def test_local_ranks_are_labelled_and_logged(tmp_path: Path) -> None:
    """A real 2-rank local launch, one restart, each attempt failing on another rank: the terminal and
    ranks.log label each line; `nodescale logs DIR --rank 1 / --failure` read it (the last attempt)."""
    import socket

    (tmp_path / "fail.py").write_text(LOCAL_FAIL_EACH_TIME)
    result = run_cli(["launch", "--nproc-per-node", "2", "--max-restarts", "1", "--job-dir", "jobs", "--",
                      sys.executable, "fail.py"], cwd=tmp_path, check=False)
    assert result.returncode == 1, result
    assert "[rank1]: hello from rank 1, attempt 1" in result.stdout.splitlines(), result.stdout
    assert "[rank0]: AssertionError: attempt 0 broke on rank 0" in result.stderr.splitlines(), result.stderr
    log = (tmp_path / "jobs" / "ranks.log").read_text().splitlines()
    assert "nodescale: restart 1 of 1 after rank 0 exited with 1" in log, log
    own = run_cli(["logs", "jobs", "--rank", "1"], cwd=tmp_path).stdout.splitlines()
    assert own[:2] == ["hello from rank 1, attempt 0", "hello from rank 1, attempt 1"], own
    assert not any("rank 0" in line for line in own), own
    failure = run_cli(["logs", "jobs", "--failure"], cwd=tmp_path).stdout.splitlines()
    assert failure[-1].startswith(f"nodescale: the job failed: rank 1 on {socket.gethostname()} failed first"), failure
    assert "nodescale: | AssertionError: attempt 1 broke on rank 1" in failure, failure


def test_rank_0_passes_through_and_the_log_gets_plain_lines(tmp_path: Path, capsys) -> None:
    """Rank 0's progress bar (carriage returns, cursor codes) reaches the terminal as it is; the log gets the text
    a terminal shows, labelled; other ranks are labelled on both."""
    import io
    import os

    from nodescale.launch.schedulers.local_rank_output import RankOutput

    log = io.StringIO()
    output = RankOutput(log, 2)
    bar = b"\r\x1b[2Ktrain 1/2\r\x1b[2Ktrain 2/2\r\x1b[2Kepoch 1/1 done\n"
    os.write(output.fds(0)[0], bar)
    os.write(output.fds(1)[1], b"a warning\n")
    output.close()
    terminal = capsys.readouterr()
    assert bar.decode() in terminal.out and "[rank0]" not in terminal.out
    assert terminal.err == "[rank1]: a warning\n"  # stderr stays stderr
    assert sorted(log.getvalue().splitlines()) == ["[rank0]: epoch 1/1 done", "[rank1]: a warning"]


def test_another_ranks_line_never_splits_a_line_of_rank_0(tmp_path: Path, capsys) -> None:
    """Unbuffered, ``print`` writes the text and its newline apart; a line of rank 1 written between the two
    goes before rank 0's line, not inside it (seen in a CI run: "attempt 1[rank1]: hello ...")."""
    import io
    import os
    import time

    from nodescale.launch.schedulers.local_rank_output import RankOutput

    output = RankOutput(io.StringIO(), 2)
    for fd, data in ((output.fds(0)[0], b"hello from rank 0"), (output.fds(1)[0], b"hello from rank 1\n"),
                     (output.fds(0)[0], b"\n")):
        os.write(fd, data)
        time.sleep(0.2)  # each piece read before the next is written
    output.close()
    assert capsys.readouterr().out.splitlines() == ["[rank1]: hello from rank 1", "hello from rank 0"]


@pytest.mark.multiproc
def test_logs_of_a_pbs_job_by_its_id(tmp_path: Path, pbs_run, monkeypatch: pytest.MonkeyPatch) -> None:
    """Submitted through a stand-in qsub (no PBS server here), so the job record is the real one; then run as
    PBS runs it under real mpiexec, and read back by its id: one rank, a pattern, and --follow to the end."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "qsub").write_text("#!/bin/sh\necho 4243.pbsserver\n")
    # The job has ended (F) for --follow; qstat -x columns: id, name, user, time, state, queue.
    (bin_dir / "qstat").write_text("#!/bin/sh\necho '4243.pbsserver  nodescale  me  00:00:01 F workq'\n")
    for stand_in in bin_dir.iterdir():
        stand_in.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{search_path()}")  # the registry: `isolated`'s
    hello = "import os; r = os.environ['RANK']; print(f'hello from rank {r}'); print(f'bye from rank {r}')"
    result = run_cli(["launch", "--cluster", "generic-pbs", "--nodes", "2", "--gpus-per-node", "1",
                      "--nproc-per-node", "1", "--mode", "per-gpu", "--job-dir", "jobs", "--", "python3", "-c", hello],
                     cwd=tmp_path)
    script = Path(re.search(r"^  script: (.+)$", result.stdout, re.M).group(1))
    assert "4243.pbsserver" in result.stdout, result.stdout
    job = pbs_run(script, 2, mpiexec="mpich", workdir=tmp_path, job_id="4243.pbsserver",
                  env={name: os.environ[name] for name in ("PYTHONPATH",) if name in os.environ})
    assert job.returncode == 0, job.output

    def logs(*options: str) -> list[str]:
        return run_cli(["logs", "4243.pbsserver", *options], cwd=tmp_path).stdout.splitlines()

    assert logs("--rank", "1") == ["hello from rank 1", "bye from rank 1"]
    assert sorted(logs("--grep", "^bye")) == ["[0] bye from rank 0", "[1] bye from rank 1"]  # as labelled
    assert logs("--rank", "0", "--grep", "hello", "--follow") == ["hello from rank 0"]
