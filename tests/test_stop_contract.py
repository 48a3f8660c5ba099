"""The stop contract for programs that are not nodescale's: who acts on the stop signal, what a rank starts
with, and when a job is requeued.

Pure decisions from the command (scripts read, never run); the job script's requeue lines run in bash;
a PBS job run under real mpiexec; real torchrun started the way a Slurm job starts it; a user's
Hugging Face ``Trainer`` script stopped and resumed under nodescale's local launcher. The Slurm cells
(Lightning's own requeue, nodescale.preemption, a bare exit code 3) are in test_launch_frameworks.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env, run_cli
from nodescale.errors import UserError
from nodescale.launch import requeue
from nodescale.launch.presets import load_preset
from nodescale.launch.render_pbs import render_pbs
from nodescale.launch.spec import JobSpec
from nodescale.launch.stop_handler import MAX_SCRIPT_BYTES, decide, imported_names
from proc_tree import descendants, workers_in
from scheduler_fixtures import run_pbs_job, search_path
from test_preemption import wait_until

FRAMEWORKS = Path(__file__).resolve().parent / "frameworks"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- who acts on the stop signal -------------------------------------------------------------------


@pytest.mark.parametrize(("command", "scheduler", "mode", "handler"), [
    (["nodescale", "train", "--epochs", "3"], "slurm", "torchrun", "nodescale"),
    (["python", "-m", "nodescale", "train"], "pbs", "per-gpu", "nodescale"),
    (["nodescale", "sweep-member", "DIR", "--", "nodescale", "train"], "slurm", "torchrun", "nodescale"),
    (["python", "-u", "own.py"], "slurm", "torchrun", "nodescale"),  # imports nodescale.preemption
    (["python", "light.py"], "slurm", "per-gpu", "framework"),
    (["python", "light.py"], "slurm", "torchrun", "none"),  # Lightning then runs as a torchelastic job
    (["python", "light.py"], "pbs", "per-gpu", "none"),  # Lightning requeues on Slurm only
    (["python3", "split/train.py"], "slurm", "per-gpu", "framework"),  # Lightning imported by a module beside it
    (["python", "-m", "pkg.main"], "slurm", "per-gpu", "framework"),
    (["accelerate", "launch", "--num_processes", "2", "plain.py"], "slurm", "per-gpu", "none"),
    (["python", "plain.py"], "pbs", "torchrun", "none"),
    (["python", "broken.py"], "slurm", "per-gpu", "none"),
    (["bash", "run.sh"], "slurm", "per-gpu", "none"),
    (["python", "missing.py"], "slurm", "per-gpu", "none"),
])
def test_the_stop_handler_follows_from_the_command(tmp_path: Path, command: list[str], scheduler: str, mode: str,
                                                    handler: str) -> None:
    write(tmp_path / "own.py", "import torch\nfrom nodescale import preemption\n")
    write(tmp_path / "light.py", "import os\nimport lightning as L\n")
    write(tmp_path / "split" / "train.py", "from model import Net\n")
    write(tmp_path / "split" / "model.py", "import pytorch_lightning\n")
    write(tmp_path / "pkg" / "main.py", "from pkg import model\n")
    write(tmp_path / "pkg" / "model.py", "import lightning.pytorch\n")
    write(tmp_path / "plain.py", "import torch.distributed as dist\n")
    write(tmp_path / "broken.py", "import lightning\ndef (:\n")
    write(tmp_path / "run.sh", "python light.py\n")
    assert decide(command, None, scheduler, mode, tmp_path).handler == handler


def test_reading_a_script_is_bounded_and_never_runs_it(tmp_path: Path) -> None:
    write(tmp_path / "big.py", "import lightning\n" + "#" * MAX_SCRIPT_BYTES)
    assert imported_names(tmp_path / "big.py") == set()
    payload = tmp_path / "ran"
    write(tmp_path / "evil.py", f"import lightning\nopen({str(payload)!r}, 'w')\nimport evil\n")  # imports itself
    deep = "(" * 200_000 + ")" * 200_000  # too deep for the parser: adds nothing, raises nothing
    write(tmp_path / "deep.py", f"import nodescale\nx = {deep}\n")
    assert imported_names(tmp_path / "evil.py") == {"lightning", "evil"}
    assert imported_names(tmp_path / "deep.py") == set()
    assert not payload.exists()


@pytest.mark.parametrize(("given", "scheduler", "match"), [
    ("bogus", "slurm", "not one of framework, nodescale, none"),
    ("framework", "pbs", "no framework requeues a PBS job"),
])
def test_a_stop_handler_that_cannot_be_is_refused(tmp_path: Path, given: str, scheduler: str, match: str) -> None:
    with pytest.raises(UserError, match=match):
        decide(["python", "x.py"], given, scheduler, "per-gpu", tmp_path)


@pytest.mark.parametrize(("flags", "message"), [
    (["--stop-handler", "nodescal"], "--stop-handler 'nodescal': not one of"),
    (["--max-requeues", "-1"], "--max-requeues -1: must be a whole number, at least 0"),
    (["--no-requeue", "--stop-handler", "nodescale"], "--no-requeue with --stop-handler nodescale"),
    (["--scheduler", "pbs", "--stop-handler", "framework"], "--stop-handler framework with PBS"),
])
def test_bad_stop_flags_are_one_line_errors(tmp_path: Path, flags: list[str], message: str) -> None:
    scheduler = [] if "--scheduler" in flags else ["--scheduler", "slurm"]
    args = ["launch", *scheduler, *flags, "--dry-run", "--", "python", "x.py"]
    result = run_cli(args, tmp_path, check=False)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("nodescale: error")]) == 1


def test_a_plain_script_on_pbs_gets_no_stop_signal_and_is_told_so(tmp_path: Path) -> None:
    # Before: a torchrun-mode PBS job signalled itself 120 s before its wall time, and torchrun passed the
    # signal on to a script with no handler for it (exit 138): its last two minutes were lost for nothing.
    write(tmp_path / "plain.py", "import torch.distributed as dist\n")
    result = run_cli(["launch", "--scheduler", "pbs", "--nodes", "2", "--dry-run", "--", "python", "plain.py"],
                     tmp_path)
    assert "kill -USR1" not in result.stdout and "TORCHELASTIC_SIGNALS_TO_HANDLE" not in result.stdout
    assert "qrerun" not in result.stdout
    said = [line for line in result.stderr.splitlines() if line.startswith("nodescale: stop handler")]
    assert len(said) == 1 and said[0].startswith("nodescale: stop handler none (plain.py imports neither"), said
    assert "runs until its wall time ends it" in said[0] and "nodescale.preemption" in said[0]
    lightning = run_cli(["launch", "--scheduler", "slurm", "--mode", "per-gpu", "--dry-run", "--", "python",
                         str(FRAMEWORKS / "lightning_requeue_script.py")], tmp_path)
    assert "stop handler framework (lightning_requeue_script.py imports lightning)" in lightning.stderr
    assert "--signal=B:USR1@120" in lightning.stdout and "scontrol requeue" not in lightning.stdout


# --- the job script's requeue, in bash --------------------------------------------------------------


def requeue_run(tmp_path: Path, previous: str | None, marker: str | None, status: int, count: str | None = None,
                max_requeues: int = 2) -> tuple[int, str, bool]:
    """The script's marker and requeue lines around a stand-in step; exit code, output, whether it requeued."""
    job_dir = tmp_path / "jobs"
    job_dir.mkdir(exist_ok=True)
    for name, text in (("requeue-7", previous), ("requeues-7", count)):
        (job_dir / name).unlink(missing_ok=True)
        if text is not None:
            (job_dir / name).write_text(text)
    step = [f"printf {marker!r} > \"$NODESCALE_REQUEUE_FILE\"" if marker is not None else ":",
            f"step_status={status}"]
    called = tmp_path / "requeued"
    called.unlink(missing_ok=True)
    lines = ["set -euo pipefail", "JOB=7", *requeue.marker_lines(str(job_dir), "JOB"), *step,
             *requeue.requeue_lines(f"touch {called}", "requeueing", max_requeues)]
    result = subprocess.run(["bash", "-c", "\n".join(lines)], capture_output=True, text=True, timeout=30)
    return result.returncode, result.stdout + result.stderr, called.exists()


def test_only_the_marker_requeues_and_never_without_progress_or_past_the_limit(tmp_path: Path) -> None:
    # A bare exit code 3 (any program's): before, `scontrol requeue` and exit 0, for ever.
    code, output, requeued = requeue_run(tmp_path, None, None, 3)
    assert (code, requeued) == (3, False) and "no rank wrote the requeue marker" in output, output
    code, output, requeued = requeue_run(tmp_path, None, "step=40\n", 1)  # torchrun exits 1: the marker counts
    assert (code, requeued) == (0, True) and "stopped for requeue at step 40 (requeue 1 of 2)" in output, output
    assert (tmp_path / "jobs" / "requeues-7").read_text().strip() == "1"
    code, output, requeued = requeue_run(tmp_path, "step=40\n", "step=55\n", 1, count="1")
    assert (code, requeued) == (0, True) and "(requeue 2 of 2)" in output, output
    # Resumed at 40 and stopped at 40 again: requeueing would loop for ever.
    code, output, requeued = requeue_run(tmp_path, "step=40\n", "step=40\n", 3, count="1")
    assert (code, requeued) == (3, False) and "stopped again at step 40" in output, output
    code, output, requeued = requeue_run(tmp_path, "step=40\n", "step=70\n", 3, count="2")
    assert (code, requeued) == (3, False) and "requeued 2 times already (--max-requeues 2)" in output, output
    code, output, requeued = requeue_run(tmp_path, None, "step=70\n", 3, count="junk\n$(touch x)")
    assert requeued and "(requeue 1 of 2)" in output, output


def test_a_pbs_rank_starts_with_the_default_action_and_exit_3_is_a_failure(tmp_path: Path) -> None:
    """Real mpiexec: the per-task shell catches USR1 (an ignored one would reach the program ignored, and
    Lightning would install no handler); the program's bare exit 3 is not requeued."""
    bin_dir = write(tmp_path / "fake-bin" / "qrerun", f'#!/bin/sh\ntouch {tmp_path}/qrerun-called\n').parent
    (bin_dir / "qrerun").chmod(0o755)
    probe = "import signal, sys; print('USR1 at start:', signal.getsignal(signal.SIGUSR1), flush=True); sys.exit(3)"
    spec = JobSpec(scheduler="pbs", preset="generic-pbs", nodes=2, gpus_per_node=0, nproc_per_node=1,
                   mode="per-gpu", command=[sys.executable, "-c", probe], workdir=tmp_path, job_dir=tmp_path / "jobs")
    script = write(tmp_path / "job.pbs", render_pbs(spec, load_preset("generic-pbs")))
    spec.job_dir.mkdir()  # as launch makes it
    path = os.pathsep.join([str(tmp_path / "pbs" / "bin"), str(bin_dir), search_path()])
    result = run_pbs_job(script, 2, scratch=tmp_path / "pbs", env={"PATH": path}, timeout=90)
    starts = [line for line in result.output.splitlines() if "USR1 at start:" in line]
    assert len(starts) == 2 and all(line.endswith(f"USR1 at start: {signal.SIG_DFL!s}") for line in starts), \
        result.output
    assert "no rank wrote the requeue marker" in result.output, result.output
    assert not (tmp_path / "qrerun-called").exists() and result.returncode != 0


def test_torchruns_agent_outlives_the_signal_and_its_workers_start_with_the_default_action(tmp_path: Path) -> None:
    """The lines a Slurm torchrun-mode job runs on each node, with real torchrun: USR1 to every process of
    the step (as slurmstepd sends it) ends neither the agent nor a worker that handles it."""
    worker = ("import pathlib, signal, sys, time\n"
              "pathlib.Path(sys.argv[1], 'at-start').write_text(str(int(signal.getsignal(signal.SIGUSR1))))\n"
              "signal.signal(signal.SIGUSR1, lambda *_: pathlib.Path(sys.argv[1], 'handled').write_text(''))\n"
              "while not pathlib.Path(sys.argv[1], 'handled').exists(): time.sleep(0.05)\n")
    node = f"{requeue.IGNORE_LINE}\nexec {requeue.TORCHRUN_AGENT} --standalone --nproc-per-node=1 --no-python \"$@\""
    env = {**cli_env(), "PATH": search_path()}
    process = subprocess.Popen(["bash", "-c", node, "nodescale-node", sys.executable, "-c", worker, str(tmp_path)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        assert wait_until(lambda: (tmp_path / "at-start").exists(), 120), "the worker never started"
        for pid in [process.pid, *descendants(process.pid)]:  # as slurmstepd signals every process of a step
            os.kill(pid, signal.SIGUSR1)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert (tmp_path / "at-start").read_text() == str(int(signal.SIG_DFL))
    assert (tmp_path / "handled").exists() and process.returncode == 0, output


def test_an_mp_spawn_script_trains_in_spawn_mode_under_real_mpiexec(tmp_path: Path) -> None:
    """A PBS job in spawn mode, run as PBS runs it: the script starts its own processes, which train."""
    shutil.copy(FRAMEWORKS / "spawn_script.py", tmp_path)
    spec = JobSpec(scheduler="pbs", preset="generic-pbs", nodes=1, gpus_per_node=0, nproc_per_node=1, mode="spawn",
                   command=[sys.executable, str(tmp_path / "spawn_script.py")], workdir=tmp_path,
                   job_dir=tmp_path / "jobs", stop_handler="none")
    script = write(tmp_path / "job.pbs", render_pbs(spec, load_preset("generic-pbs")))
    spec.job_dir.mkdir()  # as launch makes it
    path = os.pathsep.join([str(tmp_path / "pbs" / "bin"), search_path()])  # run_pbs_job's mpiexec first
    result = run_pbs_job(script, 1, scratch=tmp_path / "pbs", env={"PATH": path}, timeout=120)
    assert result.returncode == 0, result.output
    ranks = [json.loads(line[line.index("{"):]) for line in result.output.splitlines() if '"weight_spread"' in line]
    assert sorted(r["rank"] for r in ranks) == [0, 1], result.output
    assert all(r["sum"] == 3.0 and r["weight_spread"] == 0.0 for r in ranks) and len({r["pid"] for r in ranks}) == 2


# --- local runs -----------------------------------------------------------------------------------


def test_a_bare_exit_3_is_a_failure_under_the_local_launcher(tmp_path: Path) -> None:
    # Before: "nodescale: stopped for requeue at a checkpoint", exit 3, though no checkpoint existed.
    write(tmp_path / "model.py", "import sys\n\ndef build():\n    sys.exit(3)\n")
    result = run_cli(["train", "--model", "model.py:build", "--max-steps", "2", "--out", "run", "--no-progress"],
                     tmp_path, check=False)
    output = result.stdout + result.stderr
    assert result.returncode not in (0, 3) and "stopped for requeue" not in output, output


@pytest.mark.multiproc
def test_a_trainer_script_checkpoints_requeues_and_resumes_with_the_callback(tmp_path: Path) -> None:
    shutil.copy(FRAMEWORKS / "hf_trainer_script.py", tmp_path)
    command = [sys.executable, "-m", "nodescale", "launch", "--nproc-per-node", "2", "--", sys.executable,
               "hf_trainer_script.py"]
    process = subprocess.Popen(command, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        progress = tmp_path / "progress"
        assert wait_until(lambda: progress.exists() and progress.read_text().isdigit() and
                          int(progress.read_text()) >= 3, 240), "no progress"
        os.kill(process.pid, signal.SIGUSR1)  # the launcher passes it on to both ranks
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 3, output
    stopped = [line for line in output.splitlines() if "stopped for requeue at a checkpoint of step" in line]
    assert stopped, output
    step = int(stopped[0].split("of step ")[1].split()[0])
    assert (tmp_path / "out" / f"checkpoint-{step}").is_dir() and not workers_in(tmp_path)
    again = subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    ranks = [json.loads(line[line.index("{"):]) for line in again.stdout.splitlines() if '"resumed_from"' in line]
    assert sorted(r["rank"] for r in ranks) == [0, 1], again.stdout
    assert all(r["resumed_from"] == step and r["steps"] == step + 3 and r["world_size"] == 2 for r in ranks)
