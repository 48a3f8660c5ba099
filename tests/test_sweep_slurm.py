"""A 2x2 sweep of ``nodescale train`` as one array job on the local Slurm cluster; one member fails on purpose
and ``launch --resubmit-failed`` runs it again, alone.

One module-scoped sweep serves every assertion. The failing member passes validation (its configuration
is fine) and fails at run time: its model function raises while a marker file names its index.
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

from conftest import read_summary, run_cli
from nodescale.launch import sweep_manifest
from scheduler_fixtures import SlurmCluster, ci_presets, job_logs, search_path

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

MODEL = '''\
import os
from pathlib import Path
from torch import nn


def build(width=8):
    marker = Path(os.environ.get("NODESCALE_SWEEP_DIR", "/nonexistent"), "break-" + os.environ.get(
        "NODESCALE_SWEEP_INDEX", ""))
    if marker.exists():
        raise RuntimeError(f"member broken on purpose ({marker.name})")
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
                         "--max-steps", "4", "--no-progress", "--out", "sweep"], cwd=cwd)
        wait_for_status(directory, [0, 1, 2, 3], slurm_cluster)
        before = {i: sweep_manifest.status_path(directory, i).stat().st_mtime_ns for i in range(4)}
        codes = {i: sweep_manifest.exit_code(directory, i) for i in range(4)}
        (directory / "break-1").unlink()
        again = run_cli(["launch", "--resubmit-failed", "sweep"], cwd=cwd)
        wait_for_status(directory, [1], slurm_cluster)
        registry = [json.loads(line) for line in (cwd / "state" / "nodescale" / "jobs.jsonl").read_text().splitlines()]
        jobs = run_cli(["jobs", "--all"], cwd=cwd).stdout
        run_cli(["report", "sweep", "--out", "report"], cwd=cwd)
        yield {"cwd": cwd, "dir": directory, "first": first.stdout, "again": again.stdout, "codes": codes,
               "before": before, "registry": registry, "jobs": jobs, "report": (cwd / "report" / "report.md")}


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
