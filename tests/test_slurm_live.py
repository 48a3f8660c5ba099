"""The live cluster decides, on a real Slurm of the issue's shape: two nodes with this machine's
2 CPUs, no GPUs (no gres), node names that do not resolve, and a partition ``short`` with a
MaxTime. A generic job is sized from the nodes and runs; requests no node can meet are refused
before submission; a plain ``srun`` finds its head node by NodeAddr; ``launch`` inside ``salloc``
starts a step in that allocation, not a new job. Pure parts: test_cluster_fit.py."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import cli_env, run_cli
from nodescale.launch import sweep_manifest
from scheduler_fixtures import OwnSlurm, own_slurm_cluster

pytestmark = pytest.mark.multiproc

# A job log's lines carry their task's label (srun `0: `, MPICH `[0] `) and, in torchrun mode, `[rankN]:`.
LABEL = r"(?:\d+: |\[\d+\] )?(?:\[rank\d+\]:)?"
RANK_LINE = re.compile(rf"^{LABEL}RANK (\d+) (\S+) (\d+)$", re.M)
# Each rank says who it is, where, and in which Slurm job: in one write, so lines of two ranks never mix.
PRINT_RANK = ("import os; os.write(1, ' '.join(['RANK', os.environ.get('RANK', os.environ.get('SLURM_PROCID', '?')), "
              "os.environ['SLURMD_NODENAME'], os.environ['SLURM_JOB_ID']]).encode() + b'\\n')")


@pytest.fixture(scope="module")
def gpuless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnSlurm]:
    """Two nodes without gres, partitions debug (default, no limit) and short (MaxTime 5 minutes)."""
    with own_slurm_cluster(tmp_path_factory, nodes=2, gpus=0, short_maxtime="00:05:00") as cluster:
        yield cluster


@pytest.fixture
def cluster(gpuless: OwnSlurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> OwnSlurm:
    for name, value in gpuless.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("NODESCALE_PRESET_DIR", str(tmp_path / "presets"))
    return gpuless


def job_ids(cluster: OwnSlurm) -> set[str]:
    return set(cluster.command("squeue", "-h", "-t", "all", "-o", "%i").stdout.split())


def launch(cwd: Path, *options: str, command: list[str]) -> subprocess.CompletedProcess[str]:
    return run_cli(["launch", "--scheduler", "slurm", "--cluster", "generic-slurm", "--job-dir", "jobs", *options,
                    "--", *command], cwd=cwd, check=False)


def test_requests_no_node_can_meet_are_refused_before_submission(cluster: OwnSlurm, tmp_path: Path) -> None:
    before = job_ids(cluster)
    refusals = {
        ("--nodes", "3", "--gpus-per-node", "0"): ("partition debug has 2 nodes", "--nodes 2 or fewer"),
        ("--nodes", "2", "--gpus-per-node", "1"): ("have 1 GPUs", "--gpus-per-node 0"),  # the second case
        ("--nodes", "1", "--gpus-per-node", "0", "--queue", "short", "--time", "00:10:00"):
            ("partition short allows at most 00:05:00", "--time 00:05:00 or less"),
    }
    for options, (rule, hint) in refusals.items():
        result = launch(tmp_path, *options, command=["true"])
        assert result.returncode == 2, (options, result.stdout, result.stderr)
        assert rule in result.stderr and hint in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert job_ids(cluster) == before  # nothing was submitted
    assert not (tmp_path / "jobs").exists()


@pytest.mark.slow
def test_a_generic_job_is_sized_from_the_live_nodes_and_runs(cluster: OwnSlurm, tmp_path: Path) -> None:
    # The reproduction: generic-slurm asked for --cpus-per-task=16 and pended (PartitionConfig).
    result = launch(tmp_path, "--nodes", "2", "--gpus-per-node", "0", "--time", "00:05:00",
                    command=[sys.executable, "-c", PRINT_RANK])
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"^submitted slurm job (\d+)$", result.stdout, re.M)[1]  # type: ignore[index]
    script = Path(re.search(r"^  script: (.+)$", result.stdout, re.M)[1])  # type: ignore[index]
    assert f"#SBATCH --cpus-per-task={cluster.cpus_per_node}\n" in script.read_text()
    assert cluster.wait_until_done(job_id, timeout=180) == "COMPLETED", cluster.log_tail()
    output = (tmp_path / "jobs" / f"slurm-{job_id}.out").read_text()
    assert {host for _, host, _ in RANK_LINE.findall(output)} == {"node1", "node2"}, output


def resolves(name: str) -> bool:
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_plain_srun_finds_an_unresolvable_head_node_by_its_node_addr(cluster: OwnSlurm, tmp_path: Path) -> None:
    if resolves("node1"):
        pytest.skip("node1 resolves on this machine: nothing to look up")
    script = tmp_path / "init_script.py"
    script.write_text("import torch, torch.distributed as dist, nodescale\n"
                      "with nodescale.init() as ctx:\n"
                      "    total = torch.ones(1) * (ctx.rank + 1)\n"
                      "    dist.all_reduce(total)\n"
                      "    print('INIT', ctx.rank, ctx.env.master_addr, int(total.item()), flush=True)\n")
    result = subprocess.run(["srun", "-N2", "-n2", "--time=2", sys.executable, str(script)], cwd=tmp_path,
                            env=cli_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(re.findall(r"^INIT (\d) (\S+) (\d+)$", result.stdout, re.M)) == [
        ("0", "127.0.0.1", "3"), ("1", "127.0.0.1", "3")], result.stdout + result.stderr


def wait_until_idle(cluster: OwnSlurm, timeout: float = 120) -> None:
    """Every node idle: under load the previous test's step may still be completing, and salloc would queue."""
    deadline = time.monotonic() + timeout
    while (states := set(cluster.command("sinfo", "-h", "-N", "-o", "%T").stdout.split())) != {"idle"}:
        if time.monotonic() > deadline:
            pytest.fail(f"the nodes did not become idle in {timeout:.0f} s: {states}", pytrace=False)
        time.sleep(1)


MEMBER = ("import os; os.write(1, ('MEMBER ' + os.environ['NODESCALE_SWEEP_WORD'] + ' ' + os.environ['SLURM_JOB_ID'] "
          "+ ' ' + os.environ['SLURMD_NODENAME'] + chr(10)).encode())")


@pytest.mark.slow
def test_launch_inside_salloc_starts_a_step_there(cluster: OwnSlurm, tmp_path: Path) -> None:
    """One allocation: a launch runs as a step there, then a sweep's two members run one after another as steps."""
    wait_until_idle(cluster)
    before = job_ids(cluster)
    launch = [sys.executable, "-m", "nodescale", "launch", "--scheduler", "slurm", "--cluster", "generic-slurm",
              "--nodes", "2", "--gpus-per-node", "0", "--job-dir", "jobs"]
    both = (f"{shlex.join([*launch, '--nproc-per-node', '2', '--', sys.executable, '-c', PRINT_RANK])} && "
            f"{shlex.join([*launch, '--sweep', 'word=a,b', '--', sys.executable, '-c', MEMBER])}")
    assert cluster.cpus_per_node >= 2, f"the nodes have {cluster.cpus_per_node} CPU: salloc -c2 would pend for ever"
    argv = ["salloc", "-N2", "-c2", "--time=3", "--immediate=120", "bash", "-c", both]
    result = subprocess.run(argv, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=240)
    if "Granted job allocation" not in result.stderr + result.stdout:  # say what the cluster said
        jobs = cluster.command("squeue", "-h", "-t", "all", "-o", "%i %T %r").stdout
        nodes = cluster.command("scontrol", "show", "nodes").stdout
        pytest.fail(f"salloc got no allocation: {result.stderr}\n{jobs}\n{nodes}\n{cluster.log_tail(40)}",
                    pytrace=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    allocation = re.search(r"Granted job allocation (\d+)", output)[1]  # type: ignore[index]
    assert f"nodescale: in slurm allocation {allocation}: starting the job as a step there" in output
    ranks = RANK_LINE.findall(output)
    assert sorted(rank for rank, _, _ in ranks) == ["0", "1", "2", "3"], output
    assert {host for _, host, _ in ranks} == {"node1", "node2"} and {job for _, _, job in ranks} == {allocation}
    assert job_ids(cluster) - before == {allocation}  # no job but salloc's own, the sweep's members included
    assert "scontrol requeue" not in next((tmp_path / "jobs").glob("*-step-*.sh")).read_text()
    assert f"nodescale: in slurm allocation {allocation}: each member runs as a step there" in output
    sweep = next((tmp_path / "jobs" / "sweeps").iterdir())
    for index, word in enumerate("ab"):
        text = (sweep / "logs" / f"{index}.log").read_text()
        assert sorted(re.findall(rf"^{LABEL}(MEMBER .+)$", text, re.M)) == [
            f"MEMBER {word} {allocation} node1", f"MEMBER {word} {allocation} node2"], text
        assert sweep_manifest.exit_code(sweep, index) == 0
    assert "2 members run, 0 failed" in output


@pytest.mark.slow
def test_launch_inside_an_interactive_pbs_job_runs_mpiexec_there(tmp_path: Path, pbs_run) -> None:
    # qsub -I gives a shell on the first node with the job's variables; PBS_ENVIRONMENT says interactive.
    shell = tmp_path / "interactive.sh"
    rank = "import os; os.write(1, ('PBSRANK ' + os.environ['RANK'] + chr(10)).encode())"
    member = "import os; os.write(1, ('WORD ' + os.environ['NODESCALE_SWEEP_WORD'] + chr(10)).encode())"
    launch = (f"{sys.executable} -m nodescale launch --scheduler pbs --cluster generic-pbs --nodes 2 --gpus-per-node 0 "
              "--job-dir jobs")
    shell.write_text(f"cd {tmp_path}\n{launch} -- {sys.executable} -c {shlex.quote(rank)} && "
                     f"{launch} --sweep word=a,b -- {sys.executable} -c {shlex.quote(member)}\n")
    result = pbs_run(shell, 2, env={"PBS_ENVIRONMENT": "PBS_INTERACTIVE",
                                    "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert result.returncode == 0, result.output
    assert f"nodescale: in pbs allocation {result.job_id}: starting the job as a step there" in result.output
    assert sorted(re.findall(rf"^{LABEL}PBSRANK (\d)$", result.output, re.M)) == ["0", "1"], result.output
    # mpiexec's daemons on both nodes: for the launch, then for each of the sweep's 2 members
    assert sorted(result.daemons) == ["127.0.0.2"] * 3 + ["127.0.0.3"] * 3, result
    assert f"nodescale: in pbs allocation {result.job_id}: each member runs as a step there" in result.output
    sweep = next((tmp_path / "jobs" / "sweeps").iterdir())
    for index, word in enumerate("ab"):  # one line from each of the 2 ranks
        assert re.findall(rf"^{LABEL}(WORD \w)$", (sweep / "logs" / f"{index}.log").read_text(), re.M) == [
            f"WORD {word}"] * 2
