"""A 1- and 2-node scaling study on the local Slurm cluster: two chained jobs that each gather the results as
they end, then --collect by hand and report.

One module-scoped study serves every assertion: a tiny model for a few steps, no GPUs (one process per
node), so world sizes 1 and 2 with the global batch split over them (strong scaling).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import read_summary, run_cli
from nodescale.bench import scaling_study
from scheduler_fixtures import SlurmCluster, ci_presets, job_logs, search_path

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

MODEL = '''\
from torch import nn


def build(width=8):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
'''


def wait_for_jobs(directory: Path, slurm: SlurmCluster, timeout: float = 240) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = scaling_study.job_states(scaling_study.read(directory))
        if all(state == scaling_study.DONE or state.startswith("failed") for state in states.values()):
            return states
        time.sleep(1)
    logs = job_logs(directory.parent / "jobs")
    pytest.fail(f"the study's jobs did not end in {timeout:.0f} s ({states})\n{logs}\n{slurm.log_tail()}",
                pytrace=False)


@pytest.fixture(scope="module")
def study(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cwd = tmp_path_factory.mktemp("study")
    presets = ci_presets(cwd, slurm_cluster)
    (cwd / "tiny.py").write_text(MODEL)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**slurm_cluster.env, "XDG_STATE_HOME": str(cwd / "state"),
                            "NODESCALE_PRESET_DIR": str(presets), "PATH": search_path()}.items():
            patch.setenv(name, value)
        submitted = run_cli(["bench", "scaling", "--cluster", "ci-slurm", "--nodes", "1,2", "--sequential",
                             "--time", "00:10:00", "--gpus-per-node", "0", "--job-dir", "jobs", "--out", "study",
                             "--model", "tiny.py:build", "--max-steps", "6", "--warmup-steps", "2",
                             "--batch-size", "16"], cwd=cwd)
        states = wait_for_jobs(cwd / "study", slurm_cluster)
        jobs = scaling_study.read(cwd / "study").jobs
        for job in jobs:  # ended: the gathering after the step included
            slurm_cluster.wait_until_done(str(job.job_id), timeout=120)
        gathered = cwd / "study" / "scaling.json"
        gathered = json.loads(gathered.read_text()) if gathered.is_file() else None
        collected = run_cli(["bench", "scaling", "--collect", "study"], cwd=cwd)
        run_cli(["report", "study", "--out", "report"], cwd=cwd)
        yield {"cwd": cwd, "dir": cwd / "study", "submitted": submitted.stdout, "states": states,
               "gathered": gathered, "job_logs": [Path(str(job.log)).read_text() for job in jobs],
               "collected": collected.stdout, "report": (cwd / "report" / "report.md").read_text()}


def test_one_job_per_node_count_chained_after_the_one_before(study: dict[str, Any]) -> None:
    ids = re.findall(r"^submitted slurm job (\d+): (\d) node", study["submitted"], re.M)
    assert [nodes for _, nodes in ids] == ["1", "2"], study["submitted"]
    assert f"(after {ids[0][0]})" in study["submitted"]
    assert study["states"] == {1: "done", 2: "done"}
    for nodes, world, batch in ((1, 1, 16), (2, 2, 8)):  # strong: the global 16 over the processes
        summary = read_summary(study["dir"] / f"nodes-{nodes}")
        assert (summary["world_size"], summary["batch_size_per_process"], summary["global_steps"]) == (world, batch, 6)


def test_report_gives_speedup_and_efficiency_against_nodes(study: dict[str, Any]) -> None:
    rows = [line.split("|")[1:-1] for line in study["report"].splitlines() if re.match(r"^\| [12] \|", line)]
    assert [(cells[0].strip(), cells[1].strip()) for cells in rows] == [("1", "1"), ("2", "2")], study["report"]
    assert rows[0][5].strip() == "1.00" and rows[0][7].strip() == "100.0"  # speedup, efficiency of the base
    assert all(re.fullmatch(r"\d+\.\d+", cells[5].strip()) for cells in rows)
    assert "A study across node counts, one slurm job per count: 1 node(s): done" in study["report"]
    assert "| nodes | processes |" in study["report"]
    assert re.search(r"^\s+2 node\(s\), job \d+: done$", study["collected"], re.M), study["collected"]
    assert (study["dir"] / "scaling.json").is_file()


def test_each_job_gathers_the_results_as_it_ends(study: dict[str, Any]) -> None:
    """No --collect by hand before this: the first job gathered its own size (the second still waiting), the
    second both; the hand --collect above reads the same."""
    first, second = study["job_logs"]
    assert re.search(r"^\s+1 node\(s\), job \d+: done$", first, re.M), first
    assert re.search(r"^\s+2 node\(s\), job \d+: pending$", first, re.M), first
    assert re.search(r"^\s+2 node\(s\), job \d+: done$", second, re.M), second
    gathered = study["gathered"]
    assert gathered is not None, study["job_logs"]
    assert [(row["nodes"], row["world_size"]) for row in gathered["rows"]] == [(1, 1), (2, 2)]
    assert [job["state"] for job in gathered["study"]["jobs"]] == ["done", "done"]
    assert gathered["rows"][0]["speedup"] == 1.0
