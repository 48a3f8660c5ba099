"""Framework users' own scripts under ``nodescale launch --mode per-gpu`` on a real Slurm cluster.

Lightning, Accelerate and DeepSpeed each read the variables per-gpu mode gives every task
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or Slurm's own: each
script in ``tests/frameworks`` is submitted to the local two-node cluster, one task per node,
and every rank must report world size 2, its own rank, a value all-reduced across both ranks,
and weights that agree across ranks after a few steps.

The cluster's nodes have one fake GPU each and per-gpu mode starts one task per GPU, so the jobs
ask for ``--gpus-per-node 1``; the scripts still train on the CPU (gloo). A framework that is not
installed skips its test, or fails it where ``CI`` is set (``bash scripts/test-setup.sh``
installs them).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from nodescale.launch.rank_logs import parse
from required import require_module
from scheduler_fixtures import SlurmCluster
from test_launch_schedulers import finish, isolated, launch_slurm, slurm, submitted  # noqa: F401 (fixtures)
from test_preemption import wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parent / "frameworks"


def run_script(slurm: SlurmCluster, tmp_path: Path, name: str, timeout: float = 240,  # noqa: F811
               options: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Submit ``tests/frameworks/NAME`` (copied into a folder of its own) on 2 nodes x 1 task; its JSON lines."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(SCRIPTS / name, work / name)
    result = launch_slurm(work, "--nodes", "2", "--gpus-per-node", "1", "--nproc-per-node", "1",
                          "--mode", "per-gpu", *options, command=[sys.executable, name])
    job_id, _, log = submitted(result.stdout)
    output = finish(slurm, job_id, log, timeout)
    ranks = [json.loads(line.text) for line in parse(output.splitlines()) if line.text.startswith("{")]
    # Exactly two lines: a process the framework started itself would have printed one too.
    assert sorted(rank["rank"] for rank in ranks) == [0, 1], output
    for rank in ranks:
        assert rank["world_size"] == 2, rank
        assert rank["sum"] == 1.0 + 2.0, rank  # all-reduced: each rank's rank + 1
        assert rank["steps"] == 3, rank
        assert rank["weight_spread"] == 0.0, rank  # the replicas stayed in step
    assert len({rank["pid"] for rank in ranks}) == 2
    # The scripts write nothing: the folder they ran in holds them and the job's script and logs only.
    assert {path.name for path in work.iterdir()} == {"jobs", name}, list(work.iterdir())
    assert sorted(path.suffix for path in (work / "jobs").iterdir()) == [".err", ".out", ".sh"]
    return ranks


def test_lightning_ddp(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    require_module("lightning", "a lightning script under nodescale launch")
    ranks = run_script(slurm, tmp_path, "lightning_script.py")
    for rank in ranks:
        # Under srun Lightning reads Slurm's variables itself and starts no processes of its own.
        assert rank["environment"] == "SLURMEnvironment", rank
        assert rank["external"] is True, rank


def test_lightning_without_its_slurm_detection(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    # A job named "interactive" is Lightning's documented way to turn its Slurm detection off:
    # it then reads torchrun's variables, and needs the node's rank (GROUP_RANK) from per-gpu mode.
    require_module("lightning", "a lightning script under nodescale launch")
    ranks = run_script(slurm, tmp_path, "lightning_script.py", options=("--job-name", "interactive"))
    assert {rank["environment"] for rank in ranks} == {"LightningEnvironment"}, ranks


def test_accelerate(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    require_module("accelerate", "an accelerate script under nodescale launch")
    ranks = run_script(slurm, tmp_path, "accelerate_script.py")
    assert {rank["distributed_type"] for rank in ranks} == {"DistributedType.MULTI_CPU"}, ranks


def test_deepspeed_zero1(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    require_module("deepspeed", "a deepspeed script under nodescale launch")
    ranks = run_script(slurm, tmp_path, "deepspeed_script.py")
    assert {rank["zero_stage"] for rank in ranks} == {1}, ranks


def test_a_stop_signal_requeues_through_its_own_handler(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    """The requeue cells of docs/launch.md's table, live and at once (three nodes, the last job waits for one):

    - Lightning requeues itself (stop handler framework): its ranks start with USR1's default action, so it
      installs its handler (before, every rank started with it ignored: no checkpoint, no requeue);
    - a plain DDP script with nodescale.preemption (stop handler nodescale), under torchrun's agent,
      checkpoints, is requeued by the job script and resumes;
    - a bare exit code 3, even with --stop-handler nodescale, is a failure, not a requeue (before, the job
      script requeued it, for ever on a real cluster).
    """
    require_module("lightning", "a lightning script under nodescale launch")
    jobs = {}
    per_gpu = ("--gpus-per-node", "1", "--nproc-per-node", "1", "--mode", "per-gpu")  # one task per (fake) GPU
    for name, script, options in (("lightning", "lightning_requeue_script.py", ("--nodes", "2", *per_gpu)),
                                  ("helper", "preemption_script.py", ("--gpus-per-node", "0", "--nproc-per-node",
                                                                      "2", "--mode", "torchrun")),
                                  ("exit3", None, (*per_gpu, "--stop-handler", "nodescale"))):
        work = tmp_path / name
        work.mkdir()
        command = [sys.executable, "-c", "import sys; sys.exit(3)"]
        if script is not None:
            shutil.copy(SCRIPTS / script, work / script)
            command = [sys.executable, script]
        result = launch_slurm(work, *options, command=command)
        said = [line for line in result.stderr.splitlines() if line.startswith("nodescale: stop handler")]
        jobs[name] = (work, *submitted(result.stdout), said)
    assert jobs["lightning"][4][0].startswith("nodescale: stop handler framework (lightning_requeue_script.py")
    assert jobs["helper"][4][0].startswith("nodescale: stop handler nodescale (preemption_script.py imports")

    def ready(name: str) -> bool:
        work = jobs[name][0]
        if name == "lightning":  # both ranks wait outside any collective for the signal
            return (work / "ready-0").exists() and (work / "ready-1").exists()
        progress = work / "progress"
        return progress.exists() and progress.read_text().isdigit() and int(progress.read_text()) >= 5

    try:
        for name in ("lightning", "helper"):
            work, job_id, _, log, _ = jobs[name]
            assert wait_until(lambda name=name: ready(name), 240), \
                f"{name}: no progress\n{log.read_text(errors='replace')}"
            slurm.command("scancel", "--signal=USR1", "--batch", job_id)
        outputs = {}
        for name in ("lightning", "helper"):
            work, job_id, _, log, _ = jobs[name]
            requeued = wait_until(lambda job_id=job_id: slurm.job_fields(job_id).get("Restarts") == "1", 120)
            assert requeued, f"{name} was not requeued: {slurm.job_fields(job_id)}\n{log.read_text(errors='replace')}"
            outputs[name] = finish(slurm, job_id, log, 300)
        exit3_state = slurm.wait_until_done(jobs["exit3"][1], 120)
    finally:
        for job in jobs.values():
            slurm.command("scancel", job[1], check=False)
    for name, resumed in (("lightning", 5), ("helper", None)):
        ranks = [json.loads(line.text) for line in parse(outputs[name].splitlines()) if line.text.startswith("{")]
        assert sorted(rank["rank"] for rank in ranks) == [0, 1], outputs[name]
        start = ranks[0]["resumed_from"]
        assert start >= 5 and (resumed is None or start == resumed), outputs[name]
        assert all(rank["resumed_from"] == start and rank["steps"] == start + 3 for rank in ranks), ranks
    assert (jobs["lightning"][0] / "hpc_ckpt_1.ckpt").is_file()
    assert "stopped for requeue" not in outputs["lightning"]  # Lightning requeued it, nodescale did not
    assert {rank["environment"] for rank in [json.loads(line.text) for line in parse(
        outputs["lightning"].splitlines()) if line.text.startswith("{")]} == {"SLURMEnvironment"}
    assert f"stopped for requeue at step {start_of(outputs['helper'])} (requeue 1 of 20)" in outputs["helper"]
    exit3_log = jobs["exit3"][3].read_text(errors="replace")
    assert exit3_state == "FAILED" and slurm.job_fields(jobs["exit3"][1]).get("Restarts", "0") == "0", exit3_log
    assert "no rank wrote the requeue marker" in exit3_log, exit3_log


def start_of(output: str) -> int:
    """The step a run resumed from, from its ranks' JSON lines."""
    return next(json.loads(line.text)["resumed_from"] for line in parse(output.splitlines())
                if line.text.startswith("{"))
