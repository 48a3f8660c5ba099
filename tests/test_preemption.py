"""Preemption: a stop signal makes every rank checkpoint the same step and exit for requeue.

Locally (two ranks, the signal sent to one of them only), on the real local Slurm cluster
(``scancel --signal=USR1 --batch``: the job is requeued and resumes), and for PBS by running
the rendered script as PBS would with a stand-in ``qrerun`` (no PBS server here: what is
exercised is the script's trap, its mapping of the exit code, and the call to qrerun).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli_env, read_metrics
from nodescale.config.schema import RunConfig
from nodescale.engine.preemption import MAX_STOP_CHECK_STEPS, STOP_CHECK_SECONDS, StopRequest, steps_between_checks
from nodescale.errors import UserError
from nodescale.launch.presets import load_preset
from nodescale.launch.render_pbs import render_pbs
from nodescale.launch.spec import JobSpec
from nodescale.stop_signals import EXIT_REQUEUE, REQUEUE_FILE_VARIABLE, normalise_signal_names
from proc_tree import worker_of_rank, workers_in
from scheduler_fixtures import SlurmCluster, run_pbs_job
from test_launch_schedulers import isolated, launch_slurm, slurm, submitted  # noqa: F401


def test_signal_names_are_normalised_and_checked() -> None:
    assert normalise_signal_names("usr1, SIGTERM,USR1") == "SIGUSR1,SIGTERM"
    assert normalise_signal_names("none") == ""
    assert RunConfig.model_validate({"train": {"stop_signals": "term"}}).train.stop_signals == "SIGTERM"
    with pytest.raises(UserError, match="SIGKILL"):
        normalise_signal_names("SIGKILL")


def test_single_process_stop_request_and_handlers_restored() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    stop = StopRequest([signal.SIGUSR2], distributed=False)
    try:
        assert not stop.agreed()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.agreed() and stop.signal_name == "SIGUSR2"
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGUSR2) == before


def test_small_steps_agree_on_a_stop_every_few_tenths_of_a_second() -> None:
    assert steps_between_checks(0.010) == int(STOP_CHECK_SECONDS / 0.010) > 1  # cnn-digits on a CPU core
    assert steps_between_checks(5.0) == 1  # a large model's step: every step
    assert steps_between_checks(1e-6) == MAX_STOP_CHECK_STEPS
    assert steps_between_checks(0.0) == steps_between_checks(float("nan")) == 1  # no warm-up measured


def last_step(run_dir: Path) -> int:
    try:
        steps = [r["step"] for r in read_metrics(run_dir) if r.get("kind") == "step"]
    except (OSError, json.JSONDecodeError):
        return 0
    return max(steps, default=0)


def wait_until(probe, timeout: float, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(every)
    return probe()


TRAIN = ["--nproc", "2", "--epochs", "200", "--max-steps", "100000", "--log-every", "5", "--no-progress",
         "--out", "run", "--resume", "--heartbeat-timeout", "0"]


def stop_with_a_signal(tmp_path: Path, target: str, after_step: int) -> tuple[int, str]:
    """Start TRAIN, send SIGUSR1 to rank 1 or the launcher past ``after_step``, check every rank stopped at
    one checkpointed step for requeue; returns that step and the launcher's output."""
    marker = tmp_path / "requeue-marker"
    marker.unlink(missing_ok=True)
    env = {**cli_env(), REQUEUE_FILE_VARIABLE: str(marker)}
    process = subprocess.Popen([sys.executable, "-m", "nodescale", "train", *TRAIN], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert wait_until(lambda: last_step(tmp_path / "run") >= after_step, 120), "no progress"
        rank1 = worker_of_rank(process.pid, 1)
        assert rank1 is not None
        signalled_after = last_step(tmp_path / "run")
        os.kill(rank1 if target == "rank 1" else process.pid, signal.SIGUSR1)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    stopped = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "stopped"][-1]
    assert stopped["signal"] == "SIGUSR1" and stopped["exit_code"] == EXIT_REQUEUE
    step = stopped["step"]
    # No step lost, and the stop within two agreements (the last logged step may lag by a log interval).
    assert signalled_after <= step <= signalled_after + 5 + 2 * MAX_STOP_CHECK_STEPS
    assert (tmp_path / "run" / "checkpoints" / f"step-{step:08d}.pt").is_file(), output
    assert f"every rank stopped at step {step}" in output
    assert f"exited with {EXIT_REQUEUE}" in output or f"exit code {EXIT_REQUEUE}" in output, output
    assert marker.read_text().splitlines() == [f"step={step}", "run_dir=run"]  # the step the job script compares
    assert process.returncode == EXIT_REQUEUE, output  # the launcher passes the requeue code on
    assert not workers_in(tmp_path), "no worker may outlive the launcher"
    return step, output


@pytest.mark.multiproc
def test_one_rank_signalled_all_ranks_stop_checkpoint_and_resume(tmp_path: Path) -> None:
    """rank 1 only: rank 0 learns of it through the agreement; the launcher: it passes it on to its workers.

    One run for both: the job requeued after rank 1's signal is the one whose launcher is signalled.
    """
    step, _ = stop_with_a_signal(tmp_path, "rank 1", after_step=10)
    # The requeued command: the same one, which continues from the checkpoint.
    step_again, output = stop_with_a_signal(tmp_path, "launcher", after_step=step + 10)
    assert f"(step {step})" in output and "resumed from" in output
    assert len([r for r in read_metrics(tmp_path / "run") if r["kind"] == "stopped"]) == 2
    resumed = subprocess.run([sys.executable, "-m", "nodescale", "train", *TRAIN[:5], str(step_again + 3),
                              *TRAIN[6:]], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"(step {step_again})" in resumed.stdout and "resumed from" in resumed.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["global_steps"] == step_again + 3


def pbs_script(tmp_path: Path, command: list[str]) -> Path:
    spec = JobSpec(scheduler="pbs", preset="generic-pbs", nodes=1, gpus_per_node=0, nproc_per_node=1,
                   mode="per-gpu", command=command, workdir=tmp_path, job_dir=tmp_path / "jobs")
    path = tmp_path / "job.pbs"
    path.write_text(render_pbs(spec, load_preset("generic-pbs")))
    return path


@pytest.mark.multiproc
def test_pbs_script_passes_the_signal_on_and_reruns_on_the_requeue_code(tmp_path: Path) -> None:
    # A stand-in for qrerun that records its call: without a PBS server, the rerun itself is not exercised.
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    (bin_dir / "qrerun").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/qrerun-called\n')
    (bin_dir / "qrerun").chmod(0o755)
    # A rank that stops on USR1 as nodescale's rank 0 does: the requeue marker, then the requeue code.
    # (Hydra's mpiexec exits 0 after passing a signal on, whatever the ranks' codes: the marker counts.)
    rank = ("import os, signal, sys, time, pathlib\n"
            "def stop(*_):\n"
            f"    marker = pathlib.Path(os.environ[{REQUEUE_FILE_VARIABLE!r}])\n"
            "    marker.parent.mkdir(parents=True, exist_ok=True)\n"
            "    marker.write_text('step=7\\n')\n"
            "    sys.exit(3)\n"
            "signal.signal(signal.SIGUSR1, stop)\n"
            f"pathlib.Path({str(tmp_path / 'ready')!r}).write_text('')\n"
            "time.sleep(60)\n")
    script = pbs_script(tmp_path, [sys.executable, "-c", rank])
    # run_pbs_job's own bin folder (its mpiexec wrapper) first, as it sets PATH itself.
    path = os.pathsep.join([str(tmp_path / "pbs" / "bin"), str(bin_dir), str(Path(sys.executable).parent),
                            "/usr/local/bin", "/usr/bin", "/bin"])
    import threading

    def signal_the_batch_shell() -> None:
        if wait_until(lambda: (tmp_path / "ready").exists(), 60):
            for pid in [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if cmdline[:2] == [b"/bin/bash", str(script).encode()]:
                    os.kill(pid, signal.SIGUSR1)  # as `qsig -s USR1` does

    signaller = threading.Thread(target=signal_the_batch_shell)
    signaller.start()
    result = run_pbs_job(script, 1, scratch=tmp_path / "pbs", env={"PATH": path}, timeout=90)
    signaller.join()
    assert "USR1 received: passing it on" in result.output, result.output
    assert "stopped for requeue" in result.output, result.output
    assert (tmp_path / "qrerun-called").read_text().strip() == result.job_id


@pytest.mark.slow
@pytest.mark.multiproc
def test_slurm_signal_requeues_and_resumes(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    command = ["nodescale", "train", "--max-steps", "60", "--epochs", "100", "--log-every", "5",
               "--checkpoint-every", "50", "--no-progress", "--out", "run", "--resume", "--heartbeat-timeout", "0"]
    result = launch_slurm(tmp_path, "--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "1",
                          command=command)
    job_id, script, log = submitted(result.stdout)
    text = script.read_text()
    assert "#SBATCH --signal=B:USR1@120" in text and "#SBATCH --requeue" in text
    try:
        assert wait_until(lambda: last_step(tmp_path / "run") >= 10, 150), log.read_text(errors="replace")
        at_signal = last_step(tmp_path / "run")
        slurm.command("scancel", "--signal=USR1", "--batch", job_id)
        # Requeued (Restarts=1), then run again to the end.
        requeued = wait_until(lambda: (lambda f: f.get("Restarts") == "1" and f.get("JobState") == "PENDING")(
            slurm.job_fields(job_id)), 90)
        assert requeued, slurm.job_fields(job_id)
        # Slurm holds a requeued job for cred_expire (120 s by default, 10 s in scripts/slurm-local.sh:
        # its credential was revoked) before it may start again; earlier, it fails ("Job credential revoked").
        rerun = slurm.wait_for_state(job_id, {"RUNNING"}, 200)
        if rerun != "RUNNING":
            pytest.fail(f"requeued job {rerun}: {slurm.job_fields(job_id)}\n{log.read_text(errors='replace')}\n"
                        f"{slurm.log_tail(40)}", pytrace=False)
        state = slurm.wait_until_done(job_id, 150)
    finally:
        slurm.command("scancel", job_id, check=False)
    output = log.read_text(errors="replace")
    assert state == "COMPLETED", (state, output)
    records = read_metrics(tmp_path / "run")
    stopped = [r for r in records if r["kind"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["signal"] == "SIGUSR1", output
    checkpoint_step = stopped[0]["step"]
    # No step lost: the checkpoint is of a step at or after the one logged when the signal was sent.
    assert checkpoint_step >= at_signal
    assert f"resumed from run/checkpoints/step-{checkpoint_step:08d}.pt (step {checkpoint_step})" in output, output
    assert f"requeueing Slurm job {job_id}" in output
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["global_steps"] == 60
