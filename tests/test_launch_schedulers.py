"""``nodescale launch`` against real schedulers: a Slurm cluster on this machine (two slurmd
"nodes"), and PBS Pro job scripts run as PBS runs them with the real MPICH and Open MPI mpiexec.

Every test has its own job registry (XDG_STATE_HOME) and preset folder (NODESCALE_PRESET_DIR):
the user's own are never read or written. The Slurm nodes have this machine's few cores, so
the Slurm jobs use a user preset (the realistic path) that extends generic-slurm with that
core count; the cluster's one fake GPU per node lets per-gpu mode ask for --gres=gpu:1.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from conftest import read_summary, run_cli
from nodescale.distributed.env import port_for_job
from nodescale.launch.rank_logs import parse
from scheduler_fixtures import SlurmCluster, processes_with, search_path

pytestmark = pytest.mark.multiproc

SLURM_PRESET = "ci-slurm"
PBS_OPENMPI_PRESET = "ci-pbs-openmpi"


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A registry and a preset folder of this test's own; this Python's scripts first on PATH."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    presets = tmp_path / "presets"
    presets.mkdir()
    (presets / f"{PBS_OPENMPI_PRESET}.yaml").write_text(
        "extends: generic-pbs\ndescription: generic PBS with Open MPI's mpiexec\nmpiexec: openmpi\n")
    monkeypatch.setenv("NODESCALE_PRESET_DIR", str(presets))
    monkeypatch.setenv("PATH", search_path())
    return presets


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster, isolated: Path, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:  # noqa: F811
    """The session's Slurm cluster, its SLURM_CONF set, and a preset that fits its nodes."""
    for name, value in slurm_cluster.env.items():
        monkeypatch.setenv(name, value)
    (isolated / f"{SLURM_PRESET}.yaml").write_text(
        f"extends: generic-slurm\ndescription: the test cluster\ncpus_per_node: {slurm_cluster.cpus_per_node}\n")
    return slurm_cluster


def launch_slurm(cwd: Path, *options: str, command: list[str], check: bool = True):
    return run_cli(["launch", "--scheduler", "slurm", "--cluster", SLURM_PRESET, "--time", "00:10:00",
                    "--job-dir", "jobs", *options, "--", *command], cwd=cwd, check=check)


def submitted(stdout: str) -> tuple[str, Path, Path]:
    """Job id, script and log path from what `nodescale launch` printed."""
    job = re.search(r"^submitted slurm job (\S+)$", stdout, re.M)
    script = re.search(r"^  script: (.+)$", stdout, re.M)
    log = re.search(r"^  log: +(.+)$", stdout, re.M)
    assert job and script and log, stdout
    return job.group(1), Path(script.group(1)), Path(log.group(1))


def finish(slurm: SlurmCluster, job_id: str, log: Path, timeout: float = 180) -> str:
    """Wait for the job to end; fail with its output unless it COMPLETED. Returns the output."""
    state = slurm.wait_until_done(job_id, timeout)
    output = log.read_text(errors="replace") if log.exists() else f"(no {log})"
    errors = log.with_suffix(".err")
    if errors.exists():
        output += "\n--- stderr\n" + errors.read_text(errors="replace")
    if state != "COMPLETED":
        pytest.fail(f"Slurm job {job_id} ended {state}\n{output}\n{slurm.log_tail()}", pytrace=False)
    return output


def tagged_json(output: str, tag: str) -> list[dict[str, Any]]:
    """The JSON after ``TAG`` on every line, whatever rank label the launcher put before it."""
    texts = [line.text for line in parse(output.splitlines())]
    return [json.loads(text[len(tag) + 1:]) for text in texts if text.startswith(tag + " ")]


# --- Slurm ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_slurm_train_on_two_nodes(slurm: SlurmCluster, tmp_path: Path) -> None:
    result = launch_slurm(tmp_path, "--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "1",
                          command=["nodescale", "train", "--max-steps", "5", "--no-progress", "--out", "run"])
    job_id, script, log = submitted(result.stdout)
    assert script.parent == tmp_path / "jobs" and script.is_file()
    assert log == tmp_path / "jobs" / f"slurm-{job_id}.out"
    assert "--gres" not in script.read_text()  # --gpus-per-node 0: no GPU asked for

    output = finish(slurm, job_id, log)
    assert f"nodescale: rendezvous at 127.0.0.1:{port_for_job(job_id)}" in output
    fields = slurm.job_fields(job_id)
    assert fields["NumNodes"] == "2" and fields["NodeList"] == "node[1-2]", fields
    summary = read_summary(tmp_path / "run")
    assert summary["world_size"] == 2
    assert summary["global_steps"] == 5

    listed = run_cli(["jobs", "--all"], cwd=tmp_path).stdout
    line = next((row for row in listed.splitlines() if row.split()[:2] == [job_id, "slurm"]), None)
    assert line is not None and str(log) in line, listed


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [
    ["--strategy", "deepspeed", "--zero-stage", "3"],  # DeepSpeed reuses the process group srun's tasks form
    ["--strategy", "fsdp", "--sharding", "hybrid"],  # the 2-D mesh: replicate across the two nodes
])
def test_slurm_sharded_training_on_two_nodes(slurm: SlurmCluster, tmp_path: Path, strategy: list[str]) -> None:
    result = launch_slurm(tmp_path, "--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "1",
                          command=["nodescale", "train", *strategy, "--max-steps", "4", "--checkpoint-every", "2",
                                   "--no-progress", "--out", "run"])
    job_id, _, log = submitted(result.stdout)
    finish(slurm, job_id, log)
    summary = read_summary(tmp_path / "run")
    assert summary["world_size"] == 2 and summary["strategy"] == strategy[1] and summary["global_steps"] == 4
    assert (tmp_path / "run" / "checkpoints" / "step-00000004" / "trainer.pt").is_file()  # sharded, every rank


PROBE = """\
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"]
seen = {name: os.environ.get(name) for name in names}
print("PROBE " + json.dumps({**seen, "world": dist.get_world_size(), "sum": total.item()}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_slurm_per_gpu_mode_user_script(slurm: SlurmCluster, tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    result = launch_slurm(tmp_path, "--nodes", "2", "--gpus-per-node", "1", "--nproc-per-node", "1",
                          "--mode", "per-gpu", command=[sys.executable, "probe.py"])
    job_id, script, log = submitted(result.stdout)
    assert "#SBATCH --gres=gpu:1" in script.read_text()

    ranks = tagged_json(finish(slurm, job_id, log), "PROBE")
    assert sorted(int(rank["RANK"]) for rank in ranks) == [0, 1], ranks
    for rank in ranks:
        assert rank["WORLD_SIZE"] == "2" and rank["world"] == 2
        assert rank["LOCAL_RANK"] == "0" and rank["LOCAL_WORLD_SIZE"] == "1"
        assert rank["MASTER_ADDR"] == "127.0.0.1"  # node1's NodeAddr, not its unresolvable name
        assert rank["MASTER_PORT"] == str(port_for_job(job_id))
        assert rank["sum"] == 1.0 + 2.0
        assert rank["CUDA_VISIBLE_DEVICES"] == "0"  # Slurm allocated the node's (fake) GPU


SPAWNER = """\
import json, os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def work(rank, world):
    # The tutorial seed's pattern: the script starts its processes and meets them at
    # MASTER_ADDR:MASTER_PORT, which the job script exported.
    dist.init_process_group("gloo", rank=rank, world_size=world)
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    line = "SPAWN " + json.dumps({"rank": rank, "world": dist.get_world_size(), "sum": value.item(),
                                  "addr": os.environ["MASTER_ADDR"]}) + "\\n"
    os.write(1, line.encode())  # one write: the two processes share the log
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(work, args=(2,), nprocs=2)
"""


def test_slurm_spawn_mode_runs_the_command_once(slurm: SlurmCluster, tmp_path: Path) -> None:
    (tmp_path / "spawner.py").write_text(SPAWNER)
    result = launch_slurm(tmp_path, "--nodes", "1", "--gpus-per-node", "0", "--nproc-per-node", "2",
                          "--mode", "spawn", command=[sys.executable, "spawner.py"])
    job_id, script, log = submitted(result.stdout)
    assert "srun --nodes=1 --ntasks=1" in script.read_text()
    ranks = tagged_json(finish(slurm, job_id, log), "SPAWN")
    assert sorted(rank["rank"] for rank in ranks) == [0, 1], ranks  # two processes, both from one command
    assert all(rank["world"] == 2 and rank["sum"] == 3.0 and rank["addr"] == "127.0.0.1" for rank in ranks)


def test_slurm_cancel_stops_every_process(slurm: SlurmCluster, tmp_path: Path) -> None:
    marker = f"nodescale-cancel-{uuid.uuid4().hex}"
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)", marker]
    result = launch_slurm(tmp_path, "--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "1",
                          command=sleeper)
    job_id, _, log = submitted(result.stdout)
    try:
        assert slurm.wait_for_state(job_id, {"RUNNING"}, 60) == "RUNNING", log.read_text(errors="replace")
        workers = wait_for(lambda: [line for line in processes_with(marker).values() if line == " ".join(sleeper)],
                           lambda found: len(found) == 2, 60)
        assert len(workers) == 2, f"one sleeper per node expected, running: {processes_with(marker)}"
        listed = run_cli(["jobs"], cwd=tmp_path).stdout
        assert any(row.split()[:3] == [job_id, "slurm", "RUNNING"] for row in listed.splitlines()), listed

        cancelled = run_cli(["cancel", job_id], cwd=tmp_path)
        assert f"cancelled slurm job {job_id}" in cancelled.stdout
        queued = wait_for(lambda: slurm.command("squeue", "-h", "-o", "%i", "-j", job_id, check=False).stdout.split(),
                          lambda ids: job_id not in ids, 60)
        assert job_id not in queued, f"job {job_id} still queued after cancel"
        left = wait_for(lambda: processes_with(marker), lambda found: not found, 60)
        assert not left, f"processes of the cancelled job still running: {left}"
        assert slurm.job_state(job_id) == "CANCELLED"
    finally:
        slurm.command("scancel", job_id, check=False)


def wait_for(probe, done, timeout: float, every: float = 0.25):
    """Call ``probe`` until ``done(value)`` or ``timeout`` seconds; the last value."""
    deadline = time.monotonic() + timeout
    value = probe()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(every)
        value = probe()
    return value


def test_submission_errors_are_user_errors(slurm: SlurmCluster, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    refused = launch_slurm(tmp_path, "--nodes", "1", "--gpus-per-node", "0", "--queue", "no-such-partition",
                           command=["true"], check=False)
    assert refused.returncode == 2, refused
    assert "nodescale: error: sbatch" in refused.stderr
    assert "invalid partition" in refused.stderr.lower()  # Slurm's own words, passed on
    assert "Traceback" not in refused.stderr

    unknown = run_cli(["cancel", "999999"], cwd=tmp_path, check=False)
    assert unknown.returncode == 2, unknown
    assert "999999" in unknown.stderr and "Traceback" not in unknown.stderr

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # a machine without Slurm's commands
    missing = launch_slurm(tmp_path, "--nodes", "1", "--gpus-per-node", "0", command=["true"], check=False)
    assert missing.returncode == 2, missing
    assert "sbatch" in missing.stderr and "not on PATH" in missing.stderr and "Traceback" not in missing.stderr

    listed = run_cli(["jobs", "--all"], cwd=tmp_path).stdout
    assert listed.startswith("no queued or running jobs"), listed  # nothing refused was recorded


ECHO_ARGS = ("import json, os, sys; "
             "print('ARGS ' + json.dumps({'argv': sys.argv[1:], 'env': os.environ.get('NS_PAYLOAD')}), flush=True)")


def test_slurm_shell_metacharacters_arrive_literally(slurm: SlurmCluster, tmp_path: Path) -> None:
    markers = [tmp_path / f"pwned-{i}" for i in range(4)]
    arguments = [
        f"$(touch {markers[0]}); `touch {markers[1]}`; echo hi",
        "it's \"quoted\" \\ * ? ~ & | > < $HOME ${PATH} ä\ttab\nnewline",
        "--help",
    ]
    env_value = f"$(touch {markers[2]}) `touch {markers[3]}`; 'q' \"d\" \\"
    # Relative markers: both sbatch and the job run in tmp_path.
    name = "inj$(touch pwned-name-1);`touch pwned-name-2`;x"
    result = launch_slurm(tmp_path, "--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "1",
                          "--job-name", name, "--env", f"NS_PAYLOAD={env_value}",
                          command=[sys.executable, "-c", ECHO_ARGS, *arguments])
    job_id, script, log = submitted(result.stdout)

    seen = tagged_json(finish(slurm, job_id, log), "ARGS")
    assert len(seen) == 2, seen  # one process per node
    for process in seen:
        assert process["argv"] == arguments
        assert process["env"] == env_value
    created = [path for path in [*markers, tmp_path / "pwned-name-1", tmp_path / "pwned-name-2"] if path.exists()]
    assert not created, f"shell text in the job ran: {created}"
    assert re.fullmatch(r"[A-Za-z0-9_.+-]+", slurm.job_fields(job_id)["JobName"])


def test_slurm_log_path_in_a_folder_with_spaces(slurm: SlurmCluster, tmp_path: Path) -> None:
    result = launch_slurm(tmp_path, "--nodes", "1", "--gpus-per-node", "0", "--job-dir", "my jobs",
                          command=["echo", "hello from the job"])
    job_id, script, log = submitted(result.stdout)
    slurm.wait_until_done(job_id)
    assert script.parent == tmp_path / "my jobs"
    assert (tmp_path / "my jobs" / f"slurm-{job_id}.out").is_file()
    assert log == tmp_path / "my jobs" / f"slurm-{job_id}.out"
    # Cancelling a job that has ended is refused (scancel itself would say nothing).
    late = run_cli(["cancel", job_id], cwd=tmp_path, check=False)
    assert late.returncode == 2 and "has already ended (COMPLETED)" in late.stderr


def test_slurm_job_name_cannot_move_the_script(slurm: SlurmCluster, tmp_path: Path) -> None:
    result = launch_slurm(tmp_path, "--nodes", "1", "--gpus-per-node", "0", "--job-name", "../../escaped",
                          command=["true"])
    job_id, script, _ = submitted(result.stdout)
    slurm.wait_until_done(job_id)
    assert script.resolve().parent == tmp_path / "jobs"


# --- PBS Pro, run as PBS runs a job -------------------------------------------------------------------


def pbs_script(cwd: Path, cluster: str, command: list[str]) -> Path:
    """The script `nodescale launch --dry-run` prints, written where it says qsub would read it."""
    result = run_cli(["launch", "--scheduler", "pbs", "--cluster", cluster, "--nodes", "2", "--gpus-per-node", "0",
                      "--nproc-per-node", "1", "--job-dir", "jobs", "--dry-run", "--", *command], cwd=cwd)
    submit, _, script = result.stdout.partition("\n")
    assert submit.startswith("# qsub "), result.stdout
    path = Path(submit.removeprefix("# qsub "))
    assert path.parent == cwd / "jobs" and not path.exists()  # a dry run writes nothing
    assert script.startswith("#!/bin/bash\n")
    path.parent.mkdir()
    path.write_text(script)
    return path


@pytest.mark.slow
@pytest.mark.parametrize(("cluster", "flavour"), [("generic-pbs", "mpich"), (PBS_OPENMPI_PRESET, "openmpi")])
def test_pbs_train_on_two_nodes(cluster: str, flavour: str, tmp_path: Path, pbs_run) -> None:  # noqa: F811
    script = pbs_script(tmp_path, cluster, ["nodescale", "train", "--max-steps", "5", "--no-progress", "--out", "run"])
    job = pbs_run(script, 2, mpiexec=flavour, workdir=tmp_path)
    assert job.returncode == 0, job.output
    assert sorted(job.daemons) == ["127.0.0.2", "127.0.0.3"], job.output  # one mpiexec daemon per node
    assert f"nodescale: rendezvous at 127.0.0.2:{port_for_job(job.job_id)}" in job.output
    assert read_summary(tmp_path / "run")["world_size"] == 2
    assert not any(job.home.iterdir()), "the job wrote into the home directory it started in"
    assert job.output_file is not None and job.output_file.parent == tmp_path / "jobs"


# --- scheduler options and the job's software, in real jobs ---------------------------------------------------

# Lmod's `module` is an exported bash function; sbatch copies it into the job like any variable. This one
# puts a decoy python first on PATH, as a site's python module would.
MODULE_FUNCTION = '() { echo "module $*"; PATH="$DECOY_BIN:$PATH"; }'


def test_slurm_job_with_scheduler_options_in_the_submitting_venv(slurm: SlurmCluster, tmp_path: Path) -> None:
    """--mem, --exclude and --cpus-per-task reach Slurm (scontrol); the venv nodescale ran from is active in
    the job although a module load put another python first; a --mem no node has is refused (exit 2)."""
    import subprocess

    from conftest import cli_env

    venv, decoy = tmp_path / "venv", tmp_path / "decoy"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    decoy.mkdir()
    (decoy / "python").write_text("#!/bin/sh\necho decoy python\n")
    (decoy / "python").chmod(0o755)
    env = {**cli_env(), "BASH_FUNC_module%%": MODULE_FUNCTION, "DECOY_BIN": str(decoy)}

    def launch(*options: str) -> subprocess.CompletedProcess[str]:
        argv = [str(venv / "bin" / "python"), "-m", "nodescale", "launch", "--scheduler", "slurm", "--cluster",
                SLURM_PRESET, "--time", "00:10:00", "--job-dir", "jobs", "--gpus-per-node", "0", "--mode", "spawn",
                *options, "--", "bash", "-c", 'echo "PYTHON $(command -v python) VENV $VIRTUAL_ENV"']
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    too_much = launch("--mem", "3000M")  # the nodes' RealMemory is 2000 MB
    assert too_much.returncode == 2 and "Traceback" not in too_much.stderr, too_much.stderr
    # Refused before submission, from the live nodes' RealMemory, with the value that fits.
    assert "--mem 3000M" in too_much.stderr and "2000" in too_much.stderr, too_much.stderr

    result = launch("--mem", "1000M", "--exclude", "node1,node2", "--cpus-per-task", "1", "--module", "python/3",
                    "--mail-type", "END")
    assert result.returncode == 0, result.stderr
    job_id, script, log = submitted(result.stdout)
    assert f"source {venv}/bin/activate" in script.read_text().split("\n")
    output = finish(slurm, job_id, log)
    assert "module load python/3" in output  # the stand-in module function ran in the job
    assert f"PYTHON {venv}/bin/python VENV {venv}" in output, output  # the venv, not the module's decoy
    fields = slurm.job_fields(job_id)
    assert fields["NodeList"] == "node3" and fields["ExcNodeList"] == "node[1-2]", fields
    assert fields["MinMemoryNode"] == "1000M" and fields["NumCPUs"] == "1" and fields["MailType"] == "END", fields


STAND_IN_SINGULARITY = """#!/bin/bash
# Apptainer's `singularity exec [--bind B] IMAGE CMD...`, minus the container: says what it was asked, runs CMD.
[ "$1" = exec ] || exit 64
shift
binds=
if [ "$1" = --bind ]; then binds=$2; shift 2; fi
echo "STAND-IN singularity image=$1 binds=$binds"
export IN_CONTAINER=$1
shift
exec "$@"
"""


@pytest.mark.parametrize("flavour", ["mpich"])
def test_pbs_job_runs_its_command_in_the_container(flavour: str, tmp_path: Path, pbs_run) -> None:  # noqa: F811
    """--container and --container-bind: mpiexec starts the command through `singularity exec` on the node, where
    the --container-setup line runs first; the batch shell runs --setup and --module in the order typed."""
    result = run_cli(["launch", "--scheduler", "pbs", "--nodes", "1", "--gpus-per-node", "0", "--mode", "spawn",
                      "--job-dir", "jobs", "--container", "/images/torch.sif", "--container-bind", "/scratch",
                      "--container-bind", "/data:/mnt/data", "--setup", "module use /appl/ai-modules", "--module",
                      "cuda", "--container-setup", 'echo "SETUP in $IN_CONTAINER"', "--dry-run", "--",
                      "bash", "-c", 'echo "RAN in $IN_CONTAINER as $0"', "arg0"], cwd=tmp_path)
    submit, _, text = result.stdout.partition("\n")
    script = Path(submit.removeprefix("# qsub "))
    script.parent.mkdir()
    script.write_text(text)
    stand_ins = tmp_path / "stand-ins"
    stand_ins.mkdir()
    for name, body in {"singularity": STAND_IN_SINGULARITY, "module": "#!/bin/sh\necho \"module $*\"\n"}.items():
        (stand_ins / name).write_text(body)
        (stand_ins / name).chmod(0o755)
    scratch_bin = tmp_path / "pbs-0" / "bin"  # pbs_run's mpiexec wrapper (its first scratch folder)
    path = os.pathsep.join([str(stand_ins), str(scratch_bin), str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    job = pbs_run(script, 1, mpiexec=flavour, workdir=tmp_path, env={"PATH": path})
    assert job.returncode == 0, job.output
    said = [job.output.find(text) for text in [
        "module use /appl/ai-modules\nmodule load cuda\n",
        "STAND-IN singularity image=/images/torch.sif binds=/scratch,/data:/mnt/data",
        "SETUP in /images/torch.sif", "RAN in /images/torch.sif as arg0"]]
    assert -1 not in said and said == sorted(said), job.output


def test_slurm_data_pack_splits_the_shards_across_tasks_as_one_process_packs_them(slurm: SlurmCluster,
                                                                                   tmp_path: Path) -> None:
    from PIL import Image

    for name in ("ant", "bee"):
        (tmp_path / "folder" / name).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (8, 8), (40 * i, 20, 255 - 40 * i)).save(tmp_path / "folder" / name / f"{i}.png")
    pack = ["nodescale", "data", "pack", "folder", "--shard-size", "2KB", "--workers", "1"]
    result = launch_slurm(tmp_path, "--nodes", "2", "--gpus-per-node", "1", "--nproc-per-node", "1", "--mode",
                          "per-gpu", command=[*pack, "--out", "job"])
    job_id, _, log = submitted(result.stdout)
    output = finish(slurm, job_id, log)
    # Two tasks packed (each its shards i, i + 2, ...); whichever saw every shard's record wrote the manifest.
    assert output.count("another task writes the manifest") + output.count("nodescale: wrote") == 2, output
    run_cli([*pack[1:], "--out", "alone"], cwd=tmp_path)
    shards = sorted(p.name for p in (tmp_path / "alone").glob("*.tar"))
    assert len(shards) >= 4 and shards == sorted(p.name for p in (tmp_path / "job").glob("*.tar"))
    for name in shards:
        assert (tmp_path / "job" / name).read_bytes() == (tmp_path / "alone" / name).read_bytes()
    packed_by = {json.loads(r.read_text())["task"] for r in (tmp_path / "job" / ".pack").glob("*.json")}
    assert packed_by == {0, 1}  # each task wrote its own shards
    job, alone = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("job", "alone"))
    assert job == alone
