"""A 2x2 sweep of ``nodescale train`` as one array job on the local Slurm cluster; one member fails on purpose
and ``launch --resubmit-failed`` runs it again, alone.

One module-scoped sweep serves every assertion. The failing member passes validation (its configuration
is fine) and fails at run time: its model function raises while a marker file names its index.

The same sweep is preempted: the member that holds the array's own job id (its SLURM_JOB_ID is
SLURM_ARRAY_JOB_ID, so ``scontrol requeue $SLURM_JOB_ID`` would requeue every member:
Lightning-AI/pytorch-lightning#15022) is sent USR1 as Slurm's ``--signal`` sends it, on its first run. It
stops at its first step, is requeued as that member alone and resumes; the others run once.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import read_metrics, read_summary, run_cli
from nodescale.launch import sweep_manifest
from scheduler_fixtures import SlurmCluster, ci_presets, job_logs, search_path

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

MODEL = '''\
import os
import signal
import subprocess
import time
from pathlib import Path
from torch import nn


def preempt():
    """USR1 to this member's batch shell, as Slurm's --signal=B:USR1 sends it; back once it reached this rank."""
    arrived, nodescale_handler = [], signal.getsignal(signal.SIGUSR1)

    def handler(signum, frame):
        arrived.append(signum)
        nodescale_handler(signum, frame)

    signal.signal(signal.SIGUSR1, handler)
    member = os.environ["SLURM_ARRAY_JOB_ID"] + "_" + os.environ["SLURM_ARRAY_TASK_ID"]
    subprocess.run(["scancel", "--signal=USR1", "--batch", member], check=True)
    deadline = time.monotonic() + 60
    while not arrived and time.monotonic() < deadline:
        time.sleep(0.1)
    signal.signal(signal.SIGUSR1, nodescale_handler)


def build(width=8):
    sweep, index = Path(os.environ.get("NODESCALE_SWEEP_DIR", "/nonexistent")), os.environ.get("NODESCALE_SWEEP_INDEX")
    runs = sweep / f"runs-{index}"
    first = not runs.exists()
    job, array = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_ARRAY_JOB_ID")
    with runs.open("a") as record:
        record.write(f"{job} {array}\\n")
    if (sweep / f"break-{index}").exists():
        raise RuntimeError(f"member broken on purpose (break-{index})")
    if first and job == array:
        preempt()
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
'''


def wait_for_status(directory: Path, indices: list[int], slurm: SlurmCluster, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(sweep_manifest.exit_code(directory, i) is not None for i in indices):
            return
        time.sleep(1)
    logs = job_logs(directory.parent / "jobs")
    pytest.fail(f"sweep members {indices} wrote no status in {timeout:.0f} s\n{logs}\n{slurm.log_tail()}",
                pytrace=False)


@pytest.fixture(scope="module")
def swept(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The sweep submitted, run, one member resubmitted and rerun: what each step left."""
    cwd = tmp_path_factory.mktemp("sweep")
    presets = ci_presets(cwd, slurm_cluster)
    (cwd / "flaky.py").write_text(MODEL)
    directory = cwd / "sweep"
    directory.mkdir()
    (directory / "break-1").touch()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**slurm_cluster.env, "XDG_STATE_HOME": str(cwd / "state"),
                            "NODESCALE_PRESET_DIR": str(presets), "PATH": search_path()}.items():
            patch.setenv(name, value)
        first = run_cli(["launch", "--cluster", "ci-slurm", "--time", "00:10:00", "--gpus-per-node", "0",
                         "--job-dir", "jobs", "--max-concurrent", "3", "--sweep", "optim.lr=0.1,0.05",
                         "--sweep", "batch-size=16,32", "--", "nodescale", "train", "--model", "flaky.py:build",
                         "--max-steps", "4", "--no-progress", "--resume", "--out", "sweep"], cwd=cwd)
        wait_for_status(directory, [0, 1, 2, 3], slurm_cluster)
        array = re.search(r"submitted slurm job (\d+)", first.stdout)[1]
        restarts = {i: slurm_cluster.job_fields(f"{array}_{i}").get("Restarts") for i in range(4)}
        runs = {i: (directory / f"runs-{i}").read_text().splitlines() for i in range(4)}
        before = {i: sweep_manifest.status_path(directory, i).stat().st_mtime_ns for i in range(4)}
        codes = {i: sweep_manifest.exit_code(directory, i) for i in range(4)}
        (directory / "break-1").unlink()
        again = run_cli(["launch", "--resubmit-failed", "sweep"], cwd=cwd)
        wait_for_status(directory, [1], slurm_cluster)
        registry = [json.loads(line) for line in (cwd / "state" / "nodescale" / "jobs.jsonl").read_text().splitlines()]
        jobs = run_cli(["jobs", "--all"], cwd=cwd).stdout
        run_cli(["report", "sweep", "--out", "report"], cwd=cwd)
        yield {"cwd": cwd, "dir": directory, "first": first.stdout, "again": again.stdout, "codes": codes,
               "before": before, "restarts": restarts, "runs": runs, "registry": registry, "jobs": jobs,
               "report": (cwd / "report" / "report.md")}


def test_one_array_runs_every_member_with_its_settings(swept: dict[str, Any]) -> None:
    directory = swept["dir"]
    assert len(re.findall(r"^submitted slurm job \d+: sweep members 0-3$", swept["first"], re.M)) == 1
    assert swept["codes"][0] == swept["codes"][2] == swept["codes"][3] == 0
    expected = [(0.1, 16), (0.1, 32), (0.05, 16), (0.05, 32)]
    for index, (lr, batch) in enumerate(expected):
        run = directory / f"m{index:03d}"
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert (config["optim"]["lr"], config["train"]["batch_size"]) == (lr, batch), index
        assert read_summary(run)["global_steps"] == 4
    sweep = sweep_manifest.read(directory)
    assert sweep.keys == ["optim.lr", "train.batch_size"]
    assert [m.settings for m in sweep.members] == [{"optim.lr": lr, "train.batch_size": b} for lr, b in expected]
    assert [job["sweep"] for job in swept["registry"]] == [str(directory)] * 2


def test_a_failed_member_does_not_stop_the_others_and_is_rerun_alone(swept: dict[str, Any]) -> None:
    directory = swept["dir"]
    assert swept["codes"][1] not in (0, None)
    assert "3 done, 1 failed" in swept["again"] and "sweep members 1" in swept["again"], swept["again"]
    assert sweep_manifest.exit_code(directory, 1) == 0
    after = {i: sweep_manifest.status_path(directory, i).stat().st_mtime_ns for i in range(4)}
    assert [i for i in range(4) if after[i] != swept["before"][i]] == [1]  # only it ran again
    sweep = sweep_manifest.read(directory)
    assert [(s.members, s.resume) for s in sweep.submissions] == [([0, 1, 2, 3], False), ([1], True)]
    log = Path(sweep.submissions[1].log.format(index=1))
    assert log.is_file() and "member broken on purpose" not in log.read_text()
    assert read_summary(directory / "m001")["global_steps"] == 4
    assert os.path.getmtime(directory / "m001" / "summary.json") > os.path.getmtime(directory / "m000" / "summary.json")


def test_jobs_shows_one_sweep_and_report_ranks_its_members(swept: dict[str, Any]) -> None:
    sweep_lines = [line for line in swept["jobs"].splitlines() if " sweep " in line]
    assert len(sweep_lines) == 1 and "4 members: 4 done, 0 running, 0 pending, 0 failed" in sweep_lines[0], \
        swept["jobs"]
    text = swept["report"].read_text()
    rows = [re.match(r"\| \[(m\d+)\]", line).group(1) for line in text.splitlines() if line.startswith("| [m0")]
    losses = {f"m{i:03d}": read_summary(swept["dir"] / f"m{i:03d}")["val_loss"] for i in range(4)}
    assert rows == sorted(losses, key=losses.__getitem__), text


def test_a_preempted_member_is_requeued_alone_and_resumes(swept: dict[str, Any]) -> None:
    runs = swept["runs"]
    # The member holding the array's own job id: `scontrol requeue $SLURM_JOB_ID` would requeue every member.
    preempted = [i for i, lines in runs.items() if len(set(lines[0].split())) == 1]
    assert len(preempted) == 1, runs
    member = preempted[0]
    assert {i: len(lines) for i, lines in runs.items()} == {i: 1 + (i == member) for i in range(4)}, runs
    assert swept["restarts"] == {i: str(int(i == member)) for i in range(4)}, swept["restarts"]
    stopped = [r for r in read_metrics(swept["dir"] / f"m{member:03d}") if r["kind"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["signal"] == "SIGUSR1" and stopped[0]["exit_code"] == 3, stopped
    log = Path(sweep_manifest.read(swept["dir"]).submissions[0].log.format(index=member)).read_text()
    array = re.search(r"submitted slurm job (\d+)", swept["first"])[1]
    assert "USR1 received: passing it on" in log, log
    said = rf"stopped for requeue at step \d+ \(requeue 1 of 20\): requeueing Slurm job {array}_{member}\n"
    assert re.search(said, log), log
    assert re.search(rf"resumed from \S+ \(step {stopped[0]['step']}\)", log), log
