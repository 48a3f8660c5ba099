"""The bad-node file (nodescale.bad_nodes): what doctor and bench comm --pairs flag, and how a job leaves it out.

Pure parts without processes: the file's format and merging, the hosts the doctor's and the pair test's
measurements single out, ``launch --exclude-from`` rendered for Slurm and refused for PBS, and the job
script's own ``load_bad_nodes`` run by real bash on a file with hostile lines. The Slurm job that kills
a node (test_job_restarts) checks that srun's killed node lands in the same file.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest

from nodescale import bad_nodes
from nodescale.bench.comm_worker import slow_nodes
from nodescale.doctor.flagged import flagged_hosts
from nodescale.errors import UserError
from nodescale.launch.presets import load_preset
from nodescale.launch.render_slurm import render_slurm
from test_hostile_input import run_main
from test_job_restarts import spec


def test_file_round_trip_and_merge(tmp_path: Path) -> None:
    path = tmp_path / bad_nodes.FILE_NAME
    bad_nodes.add(path, {"node3": "doctor: slow\nlink\x1b[31m"})
    bad_nodes.add(path, {"node3": "later reason", "node1": "its processes died"})
    assert path.read_text() == "node3\tdoctor: slow link [31m\nnode1\tits processes died\n"
    assert bad_nodes.read(path) == {"node3": "doctor: slow link [31m", "node1": "its processes died"}
    assert bad_nodes.parse("# comment\n\nnode-2.a\n", "f") == {"node-2.a": ""}


@pytest.mark.parametrize("text", ["no de\tx\n", "$(reboot)\tx\n", "node[1-3]\tx\n", "-x\ty\n", "\tno host\n"])
def test_file_with_a_bad_host_is_refused(text: str) -> None:
    with pytest.raises(UserError, match="line 1.*must start with a node name"):
        bad_nodes.parse(text, "--exclude-from f")


def test_record_names_the_node_and_how_it_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(bad_nodes.VARIABLE, raising=False)
    assert bad_nodes.record({}, tmp_path, "doctor") == []
    [line] = bad_nodes.record({"node2": "doctor: slow"}, tmp_path, "doctor")
    assert line.startswith("nodescale doctor: flagged node node2 (doctor: slow): leave it out of a later Slurm job "
                           f"with nodescale launch --exclude-from {tmp_path}/bad-nodes.txt"), line
    assert "PBS Pro cannot leave a host out" in line
    job_file = tmp_path / "job" / "bad-nodes-7.txt"
    monkeypatch.setenv(bad_nodes.VARIABLE, str(job_file))
    [line] = bad_nodes.record({"node3": "bench comm --pairs: slow"}, None, "bench comm --pairs")
    assert "flagged node node3 (bench comm --pairs: slow): this job's next restart or requeue leaves it out" in line
    assert job_file.read_text() == "node3\tbench comm --pairs: slow\n"


def result(seconds: float, verified: bool = True, links: dict[str, float] | None = None) -> dict:
    return {"error": None, "verified": verified, "wrong": 0 if verified else 5, "bytes": 4 << 20,
            "seconds": seconds, "links": links or {}}


def test_doctor_flags_the_hosts_its_measurements_single_out() -> None:
    hosts = {0: "node1", 1: "node1", 2: "node2", 3: "node3"}
    fast = {rank: result(0.01) for rank in hosts}
    assert flagged_hosts(fast, hosts, 4) == {}
    wrong = {**fast, 3: result(0.01, verified=False)}
    assert flagged_hosts(wrong, hosts, 4) == {"node3": "doctor: all_reduce gave 5 wrong elements on rank 3"}
    assert flagged_hosts({r: result(0.01, verified=False) for r in hosts}, hosts, 4) == {}  # every host: the setup
    slow = {**fast, 2: result(0.1)}
    assert list(flagged_hosts(slow, hosts, 4)) == ["node2"]
    links = {**fast, 0: result(0.01, links={"2": 0.002, "3": 0.05})}
    assert flagged_hosts(links, hosts, 4)["node3"].startswith("doctor: link rank 0 <-> rank 3")
    assert flagged_hosts(wrong, {rank: "laptop" for rank in hosts}, 4) == {}  # one host: nothing to leave out


def test_bench_pairs_flags_slow_nodes_only() -> None:
    units = [{"unit": "node1", "median_busbw_GBps": 9.0, "slow": False},
             {"unit": "node4", "median_busbw_GBps": 1.0, "slow": True}]
    report = {"unit": "node", "units": units, "slow_below_GBps": 4.5}
    assert list(slow_nodes(report)) == ["node4"]
    assert "median sendrecv busbw 1.00 GB/s" in slow_nodes(report)["node4"]
    assert slow_nodes({**report, "unit": "rank"}) == {}


def test_job_script_loads_the_file_and_skips_hostile_lines(tmp_path: Path) -> None:
    """The script's own load_bad_nodes, in real bash: new hosts named once, lines that are no host ignored."""
    script = render_slurm(spec("slurm", "torchrun"), load_preset("generic-slurm")).splitlines()
    start = script.index("load_bad_nodes() {")
    function = "\n".join(script[start:script.index("}", start) + 1])
    listed = tmp_path / "bad.txt"
    listed.write_text("node3\tdoctor: slow\n$(touch pwned)\tx\nnode[1-2]\tx\nnode3\tagain\n\nnode1\tits processes "
                      "died (node1: task 0: Killed)")  # no final newline: the last line still counts
    test = (f'{function}\nexport NODESCALE_BAD_NODES_FILE={listed}\nbad_nodes=""\nload_bad_nodes\nload_bad_nodes\n'
            'echo "list=$bad_nodes"\nNODESCALE_BAD_NODES_FILE=/nonexistent; load_bad_nodes; echo "still=$bad_nodes"')
    out = subprocess.run(["bash", "-c", test], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["nodescale: leaving node node3 out: doctor: slow",
                                "nodescale: leaving node node1 out: its processes died (node1: task 0: Killed)",
                                "list=node3,node1", "still=node3,node1"], out
    assert not (tmp_path / "pwned").exists()


def test_launch_exclude_from(tmp_path: Path) -> None:
    (tmp_path / "bad-nodes.txt").write_text("node3\tdoctor: all_reduce busbw 0.10 GB/s on rank 2\n")
    common = ["--nodes=2", "--gpus-per-node=0", "--max-restarts=1", "--exclude-from=bad-nodes.txt", "--dry-run",
              "--", "nodescale", "train"]
    with contextlib.chdir(tmp_path):
        code, out, err = run_main(["launch", "--scheduler=slurm", "--exclude=node9", *common])
        assert code == 0, err
        assert "#SBATCH --exclude=node9,node3" in out and "excluded=node9,node3" in out  # kept on requeue
        assert "nodescale: leaving node node3 out (--exclude-from bad-nodes.txt): doctor: all_reduce busbw" in err
        code, _, err = run_main(["launch", "--scheduler=pbs", *common])
        assert code == 2 and "--exclude-from bad-nodes.txt (node3): PBS Pro cannot leave named hosts out" in err
        code, _, err = run_main(["launch", "--scheduler=slurm", "--exclude-from=.", *common[4:]])
        assert code == 2 and "--exclude-from '.': is not a file" in err, err
