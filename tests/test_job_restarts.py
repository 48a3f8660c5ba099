"""``nodescale launch --max-restarts N [--spare-nodes K]``: the job script's restart loop.

On the local 3-node Slurm cluster: a 2-node training job with one spare node whose first node's
processes are all SIGKILLed after the first checkpoint; the step runs again on the two other
nodes and the run ends with an uninterrupted run's weights. A user error is not retried. The
PBS loop runs under real mpiexec (pbs_run), and the rendered text is pinned by golden files.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

import golden_files
from conftest import final_weights, max_difference, run_cli
from nodescale.errors import UserError
from nodescale.launch.presets import load_preset
from nodescale.launch.render_pbs import render_pbs
from nodescale.launch.render_slurm import render_slurm
from nodescale.launch.spec import JobSpec
from scheduler_fixtures import SlurmCluster
from test_hostile_input import run_main
from test_launch_schedulers import finish, isolated, launch_slurm, slurm, submitted  # noqa: F401

GOLDEN = golden_files.GOLDEN_ROOT / "restarts"


def spec(scheduler: str, mode: str, **update) -> JobSpec:
    values = dict(scheduler=scheduler, preset=f"generic-{scheduler}", nodes=2, gpus_per_node=0, nproc_per_node=1,
                  mode=mode, command=["nodescale", "train", "--out", "run"], workdir=Path("/work/project"),
                  job_dir=Path("/work/project/jobs"), max_restarts=2, spare_nodes=1 if scheduler == "slurm" else 0)
    return JobSpec(**{**values, **update})


GOLDEN_CASES = {
    "slurm-torchrun": lambda: render_slurm(spec("slurm", "torchrun"), load_preset("generic-slurm")),
    "slurm-per-gpu-no-requeue": lambda: render_slurm(
        spec("slurm", "per-gpu", gpus_per_node=1, stop_handler="none", spare_nodes=0), load_preset("generic-slurm")),
    "pbs-openmpi-torchrun": lambda: render_pbs(
        spec("pbs", "torchrun"), load_preset("generic-pbs").model_copy(update={"mpiexec": "openmpi"})),
    "slurm-spawn": lambda: render_slurm(spec("slurm", "spawn"), load_preset("generic-slurm")),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_restart_loops(name: str, tmp_path: Path) -> None:
    text = GOLDEN_CASES[name]()
    golden_files.check_golden(GOLDEN / f"{name}.sh", text)
    (tmp_path / "job.sh").write_text(text)
    assert os.system(f"bash -n {tmp_path / 'job.sh'}") == 0


def test_restart_settings_in_the_script_and_refusals(tmp_path: Path) -> None:
    slurm_text = render_slurm(spec("slurm", "torchrun"), load_preset("generic-slurm"))
    assert "#SBATCH --nodes=3" in slurm_text and "#SBATCH --no-kill" in slurm_text
    assert "srun --nodes=2 --ntasks-per-node=1 --ntasks=2 --nodelist=\"$step_nodes\"" in slurm_text
    plain = render_slurm(spec("slurm", "torchrun", max_restarts=0, spare_nodes=0), load_preset("generic-slurm"))
    assert "--no-kill" not in plain and "NODESCALE_MAX_RESTARTS" not in plain and "#SBATCH --nodes=2" in plain
    # Open MPI passes on only the variables named with -x: the ranks must see the restart count.
    assert "-x NODESCALE_RESTART_COUNT" in GOLDEN_CASES["pbs-openmpi-torchrun"]()

    def refused(*argv: str) -> str:
        with contextlib.chdir(tmp_path):
            code, _, stderr = run_main(["launch", "--dry-run", *argv])
        assert code == 2 and "Traceback" not in stderr, stderr
        return stderr

    assert "PBS Pro cannot take a failed node out" in refused(
        "--scheduler", "pbs", "--max-restarts", "1", "--spare-nodes", "1", "--", "true")
    assert "a local run has one node" in refused("--spare-nodes", "1", "--", "true")
    assert "cannot restart them" in refused("--max-restarts", "1", "--mode", "spawn", "--", "true")
    assert "is a flag of `nodescale train`" in refused("--checkpoint-every", "5", "--", "nodescale", "train")
    assert "give --max-restarts to launch" in refused(
        "--scheduler", "slurm", "--", "nodescale", "train", "--max-restarts=2")
    assert "--max-restarts x" in refused("--max-restarts", "x", "--", "true")
    with pytest.raises(UserError, match="PBS Pro cannot"):
        from nodescale.launch.restarts import check_restarts

        check_restarts(spec("pbs", "torchrun", spare_nodes=1), load_preset("generic-pbs"))


FAIL_ONCE = ("import os, sys; count = os.environ.get('NODESCALE_RESTART_COUNT', '0'); "
             "print(f'ATTEMPT {count} rank', os.environ.get('RANK'), flush=True); "
             "sys.exit(int(sys.argv[1]) if count == '0' else 0)")


def test_local_launch_restarts_the_processes(tmp_path: Path) -> None:
    result = run_cli(["launch", "--max-restarts", "1", "--nproc-per-node", "1", "--",
                      sys.executable, "-c", FAIL_ONCE, "1"], cwd=tmp_path)
    assert "ATTEMPT 0 rank 0" in result.stdout and "ATTEMPT 1 rank 0" in result.stdout, result
    assert "restart 1 of 1" in result.stderr
    user_error = run_cli(["launch", "--max-restarts", "2", "--nproc-per-node", "1", "--",
                          sys.executable, "-c", FAIL_ONCE, "2"], cwd=tmp_path, check=False)
    assert user_error.returncode == 2 and "ATTEMPT 1" not in user_error.stdout, user_error


# Each attempt fails differently: rank 0 raises on the first, rank 1 on the second.
FAIL_EACH_TIME = ("import os; count = os.environ['NODESCALE_RESTART_COUNT']; rank = os.environ['RANK']; "
                  "print(f'ATTEMPT {count} rank {rank}', flush=True); "
                  "assert rank != count, f'attempt {count} broke on rank {rank}'")


@pytest.mark.multiproc
def test_pbs_loop_reruns_mpiexec_and_stops_on_a_user_error(tmp_path: Path, pbs_run) -> None:
    """Also: the failure summary of a job that failed twice names the last attempt's rank, and its host."""
    for code, expected in ((1, 0), (2, 2), ("each", 1)):
        command = [sys.executable, "-c", FAIL_ONCE, str(code)] if code != "each" else [
            sys.executable, "-c", FAIL_EACH_TIME]
        job = spec("pbs", "per-gpu", gpus_per_node=0, stop_handler="none", command=command, workdir=tmp_path,
                   job_dir=tmp_path / f"jobs-{code}", max_restarts=1 if code == "each" else 2)
        preset = load_preset("generic-pbs").model_copy(update={"mpiexec": "mpich"})
        script = tmp_path / f"job-{code}.pbs"
        script.write_text(render_pbs(job, preset))
        job.job_dir.mkdir()  # as launch makes it: the script copies its output there
        result = pbs_run(script, 2, mpiexec="mpich", workdir=tmp_path,  # the summary is this nodescale's
                         env={name: os.environ[name] for name in ("PYTHONPATH",) if name in os.environ})
        assert result.returncode == expected, result.output
        assert result.output.count("ATTEMPT 0") == 2, result.output
        if code == 1:
            assert "restart 1 of 2 on the same hosts" in result.output and result.output.count("ATTEMPT 1") == 2
        elif code == "each":
            last = result.output.splitlines()
            assert last[-1].startswith("nodescale: the job failed: rank 1 on 127.0.0.3 failed first;"), last
            assert last[-2] == "nodescale: | AssertionError: attempt 1 broke on rank 1", last
            assert "attempt 0 broke" not in "\n".join(last[-12:]), last
        else:
            assert "not restarted" in result.output and "ATTEMPT 1" not in result.output, result.output


# --- the local Slurm cluster ---------------------------------------------------------------------------


def checkpoint_steps(run_dir: Path) -> list[int]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [record["step"] for record in map(json.loads, (line for line in lines if line.endswith("}")))
                if record.get("kind") == "checkpoint"]
    except (OSError, ValueError):
        return []


def kill_step_on_node(job_id: str, node: str) -> list[int]:
    """SIGKILL every process of the job's first step on ``node`` (the nodes share this host: by environment)."""
    wanted = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURMD_NODENAME={node}".encode(), b"SLURM_STEP_ID=0"}
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if wanted <= environ:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
            except ProcessLookupError:
                pass
    return killed


TRAIN = ["nodescale", "train", "--epochs", "20", "--max-steps", "100", "--checkpoint-every", "20", "--keep-last", "9",
         "--seed", "0", "--set", "data.num_workers=0", "--no-progress", "--out", "run", "--heartbeat-timeout", "0"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_slurm_job_restarts_without_the_killed_node(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    """node1's processes killed after the step-40 checkpoint, whose file is then kept aside and removed: the
    restart resumes from step 20, on node2 and node3, and trains step 40 again to the same weights."""
    result = launch_slurm(tmp_path, "--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "1",
                          "--max-restarts", "1", "--spare-nodes", "1", command=TRAIN)
    job_id, _, log = submitted(result.stdout)
    checkpoints = tmp_path / "run" / "checkpoints"
    try:
        deadline = time.monotonic() + 150
        while 40 not in checkpoint_steps(tmp_path / "run"):
            assert time.monotonic() < deadline, log.read_text(errors="replace") if log.exists() else "no log"
            time.sleep(0.005)
        assert kill_step_on_node(job_id, "node1"), "no process of node1's step found"
        uninterrupted = final_weights(checkpoints / "step-00000040.pt")
        for path in checkpoints.iterdir():  # the restart resumes from step 20 (a save under way is removed too)
            if not path.name.startswith("step-00000020"):
                path.unlink()
        output = finish(slurm, job_id, log, timeout=180)
    finally:
        slurm.command("scancel", job_id, check=False)
    assert "nodescale: step on node1,node2, rendezvous" in output, output
    assert "nodescale: leaving node node1 out: its processes died (node1: task 0: Killed)" in output, output
    assert "nodescale: step on node2,node3 (left out: node1)" in output, output
    # The one bad-node list, where doctor and bench comm --pairs add theirs: `launch --exclude-from` reads it.
    assert (tmp_path / "jobs" / f"bad-nodes-{job_id}.txt").read_text() == \
        "node1\tits processes died (node1: task 0: Killed)\n"
    assert "restart 1 of 1 after node node1 failed (node1: task 0: Killed): resuming from step-00000020.pt" in output
    assert max_difference(uninterrupted, final_weights(checkpoints / "step-00000040.pt")) == 0.0
    assert (checkpoints / "step-00000100.pt").is_file()


@pytest.mark.multiproc
def test_slurm_user_error_is_not_retried(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    result = launch_slurm(tmp_path, "--nodes", "1", "--gpus-per-node", "0", "--nproc-per-node", "1",
                          "--max-restarts", "2", command=["nodescale", "train", "--model", "no-such-model"])
    job_id, _, log = submitted(result.stdout)
    state = slurm.wait_until_done(job_id, 120)
    output = log.read_text(errors="replace")
    assert state == "FAILED" and slurm.job_fields(job_id)["ExitCode"] == "2:0", (state, output)
    assert "nodescale: error (rank 0): model 'no-such-model'" in output, output
    assert "not restarted" in output and output.count("nodescale: step on") == 1, output
