"""``nodescale jobs`` and ``nodescale report`` on a sweep: members counted by state (from the real local Slurm
cluster's queue, then from the sweep's files), and ranked by validation loss from real ``nodescale train`` runs."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from conftest import read_summary, run_cli
from nodescale.figures import sweep_figure
from nodescale.launch import sweep_manifest
from nodescale.launch.job_log import JobRecord, record
from nodescale.launch.schedulers.pbs import parse_qstat
from nodescale.launch.schedulers.slurm import Slurm, parse_squeue
from nodescale.launch.sweep_manifest import Member, Submission, Sweep
from nodescale.launch.sweep_state import member_states
from nodescale.report.sources import SweepSource, load_source
from scheduler_fixtures import SlurmCluster, search_path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RATES = (0.1, 0.001, 0.01)  # m000 and m001 are trained; m002 failed (its exit code 1, no summary)


def make_sweep(directory: Path, rates: tuple[float, ...], submissions: list[Submission]) -> Sweep:
    """A sweep record over optim.lr as `nodescale launch --sweep` writes it, members in DIR/mNNN."""
    members = [Member(index, {"optim.lr": rate}, str(directory / f"m{index:03d}")) for index, rate in enumerate(rates)]
    sweep = Sweep("lr-sweep", directory, ["nodescale", "train", "--max-steps", "4"], ["--scheduler", "slurm"],
                  ["optim.lr"], members, submissions)
    directory.mkdir(parents=True, exist_ok=True)
    sweep_manifest.write(sweep)
    return sweep


def set_exit_code(sweep: Sweep, index: int, code: int) -> None:
    path = sweep_manifest.status_path(sweep.directory, index)
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"{code}\n")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """Three members run here: two real 4-step trainings (lr 0.1, 0.001) and one that failed (lr 0.01)."""
    directory = tmp_path_factory.mktemp("sweep") / "lr-sweep"
    sweep = make_sweep(directory, RATES, [Submission("local", "local", [0, 1, 2], False, "", time.time())])
    for member in sweep.members[:2]:
        run_cli(["train", "--nproc", "1", "--max-steps", "4", "--lr", str(member.settings["optim.lr"]),
                 "--no-progress", "--out", member.run_dir], directory)
        set_exit_code(sweep, member.index, 0)
    set_exit_code(sweep, 2, 1)
    return sweep


def _cells(text: str, first: str) -> list[str]:
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells and cells[0].startswith(first):
            return cells
    raise AssertionError(f"no table row starting {first!r} in\n{text}")


def test_report_ranks_members_by_validation_loss(sweep: Sweep, tmp_path: Path) -> None:
    run_cli(["report", str(sweep.directory), "--out", str(tmp_path)], tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "## Sweep `lr-sweep`" in text and "3 members (2 done, 0 running, 0 pending, 1 failed)" in text
    losses = {index: read_summary(Path(sweep.members[index].run_dir))["val_loss"] for index in (0, 1)}
    best, worst = sorted(losses, key=losses.__getitem__)
    rows = [line for line in text.splitlines() if line.startswith("| [m00")]
    assert [re.match(r"\| \[(m\d+)\]", row).group(1) for row in rows] == [f"m00{best}", f"m00{worst}", "m002"]
    for index in (0, 1):
        summary = read_summary(Path(sweep.members[index].run_dir))
        assert _cells(text, f"[m00{index}]")[1:] == [
            f"{RATES[index]:g}", f"{summary['val_loss']:,.4f}", f"{summary['val_accuracy']:.2%}",
            f"{summary['samples_per_second']:,.1f}", "done"]
    assert _cells(text, "[m002]")[1:] == ["0.01", "n/a", "n/a", "n/a", "failed"]
    assert "![validation loss against each setting of lr-sweep](report-lr-sweep-sweep.png)" in text
    assert (tmp_path / "report-lr-sweep-sweep.png").read_bytes()[:8] == PNG_SIGNATURE


def test_a_copied_sweep_is_read_where_it_now_is(sweep: Sweep, tmp_path: Path) -> None:
    copy = tmp_path / "copied"
    shutil.copytree(sweep.directory, copy)  # sweep.json still names the original's absolute paths
    (copy / "m001" / "summary.json").unlink()
    (copy / "status" / "1").write_text("1\n")  # status files too are the copy's
    source = load_source(copy)
    assert isinstance(source, SweepSource) and source.states == {0: "done", 1: "failed", 2: "failed"}
    assert sorted(source.summaries) == [0] and source.sweep.members[0].run_dir == str(copy / "m000")


def test_sweep_plot_has_one_point_per_finished_member_on_a_log_axis() -> None:
    points = [({"optim.lr": 0.1, "model": "cnn"}, 2.0), ({"optim.lr": 0.001, "model": "mlp"}, 1.5)]
    fig = sweep_figure(["optim.lr", "model"], points, "validation loss", "t")
    assert isinstance(fig, Figure)
    lr_axis, model_axis = fig.axes
    assert lr_axis.get_xscale() == "log" and model_axis.get_xscale() == "linear"  # 0.1 / 0.001 spans 100x
    assert list(lr_axis.lines[0].get_xdata()) == [0.1, 0.001] and list(lr_axis.lines[0].get_ydata()) == [2.0, 1.5]
    assert [tick.get_text() for tick in model_axis.get_xticklabels()] == ["cnn", "mlp"]
    narrow = sweep_figure(["optim.lr"], [({"optim.lr": 0.01}, 1.0), ({"optim.lr": 0.05}, 1.0)], "loss", "t")
    assert narrow is not None and narrow.axes[0].get_xscale() == "linear"
    assert sweep_figure(["optim.lr"], [], "loss", "t") is None


def test_report_refuses_a_corrupt_sweep_record(sweep: Sweep, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "sweep.json").write_text(json.dumps(sweep.to_json())[:-20])  # cut off mid-write
    result = run_cli(["report", str(broken)], tmp_path, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert str(broken / "sweep.json") in result.stderr and "cannot be read as a sweep record" in result.stderr


def test_jobs_lists_a_sweep_as_one_line_with_its_counts(sweep: Sweep, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    record(JobRecord("local", "local", "lr-sweep", "", "", str(tmp_path), time.time(), sweep=str(sweep.directory)))
    assert "no queued or running jobs" in run_cli(["jobs"], tmp_path).stdout  # nothing queued: --all shows it
    lines = run_cli(["jobs", "--all"], tmp_path).stdout.splitlines()
    assert len(lines) == 1 and str(sweep.directory) in lines[0]
    assert lines[0].endswith("3 members: 2 done, 0 running, 0 pending, 1 failed")
    table = run_cli(["jobs", str(sweep.directory)], tmp_path).stdout.splitlines()
    assert table[0] == lines[0]
    assert table[1].split() == ["0", "done", "optim.lr=0.1", sweep.members[0].run_dir]
    assert table[3].split() == ["2", "failed", "optim.lr=0.01", sweep.members[2].run_dir]
    refused = run_cli(["jobs", str(tmp_path)], tmp_path, check=False)
    assert refused.returncode == 2 and "holds no sweep.json" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.multiproc
def test_jobs_counts_a_slurm_arrays_members(slurm_cluster: SlurmCluster, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Members 2-4 of a real array (one at a time: 2 runs, 3 and 4 wait); 0 and 1 ended with exit codes 0 and 1."""
    for name, value in {**slurm_cluster.env, "PATH": search_path(), "XDG_STATE_HOME": str(tmp_path / "s")}.items():
        monkeypatch.setenv(name, value)
    array = slurm_cluster.command("sbatch", "--parsable", "--array=2-4%1", "-o", "/dev/null", "-J", "lr-sweep",
                                  "--wrap", "sleep 120").stdout.strip()
    try:
        sweep = make_sweep(tmp_path / "lr-sweep", (0.1, 0.01, 0.001, 0.3, 1.0),
                           [Submission(array, "slurm", [2, 3, 4], False, "", time.time())])
        set_exit_code(sweep, 0, 0)
        set_exit_code(sweep, 1, 1)
        deadline = time.monotonic() + 90
        while Slurm().status([array]).get(f"{array}_2") != "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.5)
        grouped = slurm_cluster.command("squeue", "-h", "-t", "all", "-o", "%i %T", "-j", array).stdout
        listed = Slurm().status([array])
        assert listed == {f"{array}_2": "RUNNING", f"{array}_3": "PENDING", f"{array}_4": "PENDING"}, grouped
        assert f"{array}_[3-4%1] PENDING" in grouped  # pending members as one group, expanded by status
        one_each = slurm_cluster.command("squeue", "-h", "-r", "-t", "all", "-o", "%i %T", "-j", array).stdout
        assert parse_squeue(one_each) == listed
        record(JobRecord(array, "slurm", "lr-sweep", "", "", str(tmp_path), time.time(), sweep=str(sweep.directory)))
        lines = run_cli(["jobs"], tmp_path).stdout.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{array} ") and " sweep " in lines[0]
        assert lines[0].endswith("5 members: 1 done, 1 running, 2 pending, 1 failed")
        assert "  3  pending" in run_cli(["jobs", str(sweep.directory)], tmp_path).stdout
        slurm_cluster.command("scancel", array)
        deadline = time.monotonic() + 60
        while set(Slurm().status([array]).values()) != {"CANCELLED"} and time.monotonic() < deadline:
            time.sleep(0.5)
        # Listed as ended, without exit codes or summaries: the files say how they ended.
        lines = run_cli(["jobs"], tmp_path).stdout.splitlines()
        assert lines[0].endswith("5 members: 1 done, 0 running, 0 pending, 4 failed")
    finally:
        slurm_cluster.command("scancel", array, check=False)


# `qstat -x -t` as PBS Pro prints an array 4321[] with subjobs running, queued and finished (ids shortened).
QSTAT_ARRAY = """\
Job id            Name             User              Time Use S Queue
----------------  ---------------- ----------------  -------- - -----
4321[].desched1   lr-sweep         alice                    0 B workq
4321[0].desched*  lr-sweep         alice             00:00:40 X workq
4321[1].desched*  lr-sweep         alice             00:00:12 R workq
4321[2].desched*  lr-sweep         alice                    0 Q workq
4321[10].desche*  lr-sweep         alice                    0 Q workq
4322.desched1     other            alice             00:00:05 R workq
"""


def test_pbs_status_lists_an_arrays_subjobs(tmp_path: Path) -> None:
    states = parse_qstat(QSTAT_ARRAY, ["4321[].desched1", "4322.desched1"])
    assert states == {"4321[].desched1": "B", "4321[0].desched1": "FINISHED", "4321[1].desched1": "RUNNING",
                      "4321[2].desched1": "PENDING", "4321[10].desched1": "PENDING", "4322.desched1": "RUNNING"}
    assert parse_qstat(QSTAT_ARRAY, ["4322.desched1"]) == {"4322.desched1": "RUNNING"}
    sweep = make_sweep(tmp_path, (0.1, 0.01, 0.001, 1.0), [Submission("4321[].desched1", "pbs", [0, 1, 2, 3], False,
                                                                      "", time.time())])
    set_exit_code(sweep, 0, 0)  # subjob 0 finished well; 3 is no longer listed and left nothing: failed
    assert member_states(sweep, states) == {0: "done", 1: "running", 2: "pending", 3: "failed"}
