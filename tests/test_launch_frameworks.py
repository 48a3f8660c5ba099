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

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from nodescale.launch.rank_logs import parse
from scheduler_fixtures import SlurmCluster
from test_launch_schedulers import finish, isolated, launch_slurm, slurm, submitted  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parent / "frameworks"


def require_module(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        reason = f"{name} is not installed: `bash scripts/test-setup.sh` installs it"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set: a missing framework is a failure here, not a skip)", pytrace=False)
        pytest.skip(reason)


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
    require_module("lightning")
    ranks = run_script(slurm, tmp_path, "lightning_script.py")
    for rank in ranks:
        # Under srun Lightning reads Slurm's variables itself and starts no processes of its own.
        assert rank["environment"] == "SLURMEnvironment", rank
        assert rank["external"] is True, rank


def test_lightning_without_its_slurm_detection(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    # A job named "interactive" is Lightning's documented way to turn its Slurm detection off:
    # it then reads torchrun's variables, and needs the node's rank (GROUP_RANK) from per-gpu mode.
    require_module("lightning")
    ranks = run_script(slurm, tmp_path, "lightning_script.py", options=("--job-name", "interactive"))
    assert {rank["environment"] for rank in ranks} == {"LightningEnvironment"}, ranks


def test_accelerate(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    require_module("accelerate")
    ranks = run_script(slurm, tmp_path, "accelerate_script.py")
    assert {rank["distributed_type"] for rank in ranks} == {"DistributedType.MULTI_CPU"}, ranks


def test_deepspeed_zero1(slurm: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    require_module("deepspeed")
    ranks = run_script(slurm, tmp_path, "deepspeed_script.py")
    assert {rank["zero_stage"] for rank in ranks} == {1}, ranks
