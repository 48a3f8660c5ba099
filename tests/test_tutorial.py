"""Runs docs/tutorial.md: every command of its ``bash`` blocks, in order, in an empty folder.

The tutorial's two scripts live in tests/tutorial/; the page shows them after
``<!-- file: PATH -->`` markers and their diff after ``<!-- diff: A B -->``, and
``test_doc_shows_the_files`` checks both byte for byte. Each ``## Step N`` section is one
test: its scripts are copied into a fresh folder, and each command runs there with bash,
with a registry and a preset folder of the test's own (the user's are never read or
written).

Substitutions, only for what cannot exist on a test machine:

- Step 4, the Slurm submission: ``--cluster hipergator`` becomes ``--cluster tutorial-slurm``,
  a user preset (``generic-slurm`` with this machine's core count) for the Slurm cluster that
  ``scheduler_fixtures.slurm_cluster`` starts on localhost. HiPerGator's ``hpg-ai`` partition
  and 128-core nodes do not exist here. The dry run before it runs unchanged. The test waits
  for the job to end before the command that reads its log (``cat``).
- Step 5, the PBS submission: there is no ``qsub``, no Cray PALS ``mpiexec`` (Hydra refuses
  ``--cpu-bind``) and no ``module`` command here. ``--cluster derecho`` becomes
  ``--cluster tutorial-pbs`` (``generic-pbs``: MPICH's ``mpiexec``) with ``--dry-run`` added;
  the printed script is written where it says ``qsub`` would read it and run by ``pbs_run`` as
  PBS Pro runs a job on 2 nodes. The Derecho dry run before it runs unchanged.

Without Slurm or MPICH the scheduler steps are skipped, or fail where ``CI`` is set (the
fixtures decide).
"""

from __future__ import annotations

import difflib
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import REPO, cli_env, read_summary
from scheduler_fixtures import SlurmCluster, search_path

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

DOC = REPO / "docs" / "tutorial.md"
SCRIPTS = ("train_single.py", "train_distributed.py")
SLURM_PRESET = "tutorial-slurm"
PBS_PRESET = "tutorial-pbs"
EPOCH_LINE = re.compile(r"^epoch 5: loss \d+\.\d{4}  val_acc \d+\.\d\d%$", re.M)
# In a job's log each line carries its node's label (srun `1: `, MPICH `[1] `) and torchrun's rank prefix.
JOB_EPOCH_LINE = re.compile(r"^(\d+: |\[\d+\] )\[rank0\]:epoch 5: loss \d+\.\d{4}  val_acc \d+\.\d\d%$", re.M)


# --- the page ---------------------------------------------------------------------------------------


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number of the opening fence, language, content) of every fenced block."""
    blocks = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        opening = re.match(r"^```(\w*)\s*$", lines[i])
        if opening:
            start, body = i, []
            i += 1
            while i < len(lines) and lines[i].rstrip("\n") != "```":
                body.append(lines[i])
                i += 1
            assert i < len(lines), f"docs/tutorial.md:{start + 1}: unclosed code block"
            blocks.append((start, opening.group(1), "".join(body)))
        i += 1
    return blocks


def commands(block: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, blank lines and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def step_commands() -> dict[int, list[str]]:
    """Step number -> the commands of the bash blocks under its ``## Step N`` heading."""
    text = DOC.read_text()
    lines = text.splitlines()
    steps: dict[int, list[str]] = {}
    for start, language, body in fenced_blocks(text):
        if language != "bash":
            continue
        headings = [re.match(r"^## (Step (\d+))?", line) for line in lines[:start]]
        last = [h for h in headings if h][-1:]
        assert last and last[0].group(2), f"docs/tutorial.md:{start + 1}: a bash block outside a '## Step N' section"
        steps.setdefault(int(last[0].group(2)), []).extend(commands(body))
    return steps


def test_doc_shows_the_files() -> None:
    text = DOC.read_text()
    blocks = {start: (language, body) for start, language, body in fenced_blocks(text)}
    lines = text.splitlines()
    shown = []
    for number, line in enumerate(lines):
        marker = re.match(r"^<!-- (file|diff): (.+) -->$", line)
        if not marker:
            continue
        assert number + 1 in blocks, f"docs/tutorial.md:{number + 1}: no code block right after {line}"
        language, body = blocks[number + 1]
        if marker.group(1) == "file":
            path = REPO / marker.group(2)
            assert language == "python" and body == path.read_text(), \
                f"docs/tutorial.md:{number + 2}: differs from {path}"
            shown.append(path.name)
        else:
            a, b = (REPO / name for name in marker.group(2).split())
            expected = "".join(difflib.unified_diff(a.read_text().splitlines(keepends=True),
                                                    b.read_text().splitlines(keepends=True), a.name, b.name))
            assert language == "diff" and body == expected, f"docs/tutorial.md:{number + 2}: not the diff of {a} {b}"
    assert sorted(shown) == sorted(SCRIPTS)


def test_every_command_belongs_to_a_step() -> None:
    steps = step_commands()
    assert sorted(steps) == [1, 2, 3, 4, 5, 6], steps  # each step below runs its commands
    assert sum(len(found) for found in steps.values()) >= 12, steps


# --- running it -----------------------------------------------------------------------------------


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty folder holding the two scripts, as a reader who saved them has."""
    folder = tmp_path / "tutorial"
    folder.mkdir()
    for name in SCRIPTS:
        shutil.copyfile(REPO / "tests" / "tutorial" / name, folder / name)
    return folder


@pytest.fixture
def environment(tmp_path: Path) -> dict[str, str]:
    """The reader's shell: no launcher variables, this Python's scripts first on PATH, and a job
    registry and a preset folder of this test's own."""
    presets = tmp_path / "presets"
    presets.mkdir()
    (presets / f"{PBS_PRESET}.yaml").write_text(
        "extends: generic-pbs\ndescription: the tutorial test's PBS (MPICH mpiexec)\n")
    return {**cli_env(), "PATH": search_path(), "XDG_STATE_HOME": str(tmp_path / "state"),
            "NODESCALE_PRESET_DIR": str(presets)}


def shell(command: str, cwd: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """A command as the reader types it; fails with its output unless it exits 0."""
    result = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode != 0:
        pytest.fail(f"`{command}` exited {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}",
                    pytrace=False)
    return result


def run_step(step: int, cwd: Path, env: dict[str, str],
             checks: dict[str, Callable[[str, subprocess.CompletedProcess[str] | None], None]],
             replace: Callable[[str], str | None] = lambda command: command) -> None:
    """Run the step's commands in order. ``checks`` maps a command's start to what is checked
    after it; every command must have one, so a command added to the page is noticed here.
    ``replace`` may return another command, or None when it ran the command itself."""
    for command in step_commands()[step]:
        check = next((checks[start] for start in sorted(checks, key=len, reverse=True) if command.startswith(start)),
                     None)
        assert check is not None, f"step {step}: no check for `{command}`; add one to tests/test_tutorial.py"
        actual = replace(command)
        check(command, None if actual is None else shell(actual, cwd, env))


def saved(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def test_step1_plain_script(workdir: Path, environment: dict[str, str]) -> None:
    def plain(command, result):
        assert result.stdout.startswith("training on cpu\n"), result.stdout
        assert EPOCH_LINE.search(result.stdout), result.stdout
        assert saved(workdir / "model.pt")["val_accuracy"] > 0.8

    run_step(1, workdir, environment, {"python train_single.py": plain})


def test_step2_one_process(workdir: Path, environment: dict[str, str]) -> None:
    def one(command, result):
        assert "training on cpu, world size 1\n" in result.stdout
        assert EPOCH_LINE.search(result.stdout), result.stdout
        assert saved(workdir / "model.pt")["world_size"] == 1

    run_step(2, workdir, environment, {"python train_distributed.py": one})


def test_step3_two_local_processes(workdir: Path, environment: dict[str, str]) -> None:
    def two(command, result):
        assert result.stdout.count("training on cpu, world size 2\n") == 1, result.stdout  # rank 0 prints
        assert len(EPOCH_LINE.findall(result.stdout)) == 1, result.stdout
        model = saved(workdir / "model.pt")
        assert model["world_size"] == 2 and model["val_accuracy"] > 0.8
        (workdir / "model.pt").unlink()

    run_step(3, workdir, environment, {"nodescale launch --nproc-per-node 2": two, "torchrun --nproc-per-node 2": two})


def test_step4_two_slurm_nodes(workdir: Path, environment: dict[str, str],
                               slurm_cluster: SlurmCluster) -> None:  # noqa: F811
    (Path(environment["NODESCALE_PRESET_DIR"]) / f"{SLURM_PRESET}.yaml").write_text(
        f"extends: generic-slurm\ndescription: the tutorial Slurm\ncpus_per_node: {slurm_cluster.cpus_per_node}\n")
    environment.update(slurm_cluster.env)
    job: dict[str, str] = {}

    def replace(command):
        if command.startswith("nodescale launch") and "--dry-run" not in command:
            assert "--cluster hipergator " in command
            return command.replace("--cluster hipergator ", f"--cluster {SLURM_PRESET} ")
        if command.startswith("cat "):
            finish(slurm_cluster, job)
        return command

    def dry_run(command, result):
        submit, _, script = result.stdout.partition("\n")
        assert submit.startswith(f"# sbatch --parsable {workdir}/nodescale-jobs/"), result.stdout
        for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=1",
                     "#SBATCH --partition=hpg-ai", "#SBATCH --time=00:10:00", f"cd {workdir}"):
            assert f"\n{line}\n" in script, script
        assert "srun " in script and "torchrun" in script and "--nnodes=2 --nproc-per-node=1" in script, script
        assert not (workdir / "nodescale-jobs").exists()  # a dry run writes nothing

    def submit(command, result):
        found = re.search(r"^submitted slurm job (\S+)\n  script: (.+)\n  log: +(.+)$", result.stdout, re.M)
        assert found, result.stdout
        job.update(id=found.group(1), script=found.group(2), log=found.group(3))
        assert Path(job["log"]) == workdir / "nodescale-jobs" / f"slurm-{job['id']}.out"

    def jobs(command, result):
        rows = [row.split() for row in result.stdout.splitlines()]
        assert any(row[:2] == [job["id"], "slurm"] and job["log"] in row for row in rows), result.stdout

    def log(command, result):
        assert "training on cpu, world size 2\n" in result.stdout, result.stdout
        assert JOB_EPOCH_LINE.search(result.stdout), result.stdout
        assert slurm_cluster.job_fields(job["id"])["NumNodes"] == "2"
        assert saved(workdir / "model.pt")["world_size"] == 2

    dry = "nodescale launch --cluster hipergator --nodes 2 --gpus-per-node 1 --time 00:10:00 --dry-run"
    run_step(4, workdir, environment, {"nodescale launch --cluster hipergator": submit, dry: dry_run,
                                       "nodescale jobs": jobs, "cat nodescale-jobs/slurm-": log}, replace)
    assert {"id", "log"} <= job.keys(), "step 4 never submitted"


def finish(slurm: SlurmCluster, job: dict[str, str], timeout: float = 180) -> None:
    """Wait for the job to end; fail with its output unless it COMPLETED."""
    assert "id" in job, "the log is read before a job was submitted"
    state = slurm.wait_until_done(job["id"], timeout)
    if state != "COMPLETED":
        out, err = Path(job["log"]), Path(job["log"]).with_suffix(".err")
        text = "\n".join(path.read_text(errors="replace") for path in (out, err) if path.exists())
        pytest.fail(f"Slurm job {job['id']} ended {state}\n{text}\n{slurm.log_tail()}", pytrace=False)


def test_step5_pbs_pro(workdir: Path, environment: dict[str, str], pbs_run) -> None:  # noqa: F811
    ran: dict[str, object] = {}

    def replace(command):
        if not (command.startswith("nodescale launch") and "--dry-run" not in command):
            return command
        assert "--cluster derecho " in command
        head, _, tail = command.replace("--cluster derecho ", f"--cluster {PBS_PRESET} ").partition(" -- ")
        printed = shell(f"{head} --dry-run -- {tail}", workdir, environment).stdout
        submit, _, script = printed.partition("\n")
        assert submit.startswith("# qsub "), printed
        path = Path(submit.removeprefix("# qsub "))
        path.parent.mkdir(mode=0o750)
        path.write_text(script)
        job = pbs_run(path, 2, mpiexec="mpich", workdir=workdir)
        assert job.returncode == 0, job.output
        ran["job"] = job
        return None

    def dry_run(command, result):
        submit, _, script = result.stdout.partition("\n")
        assert submit.startswith(f"# qsub {workdir}/nodescale-jobs/"), result.stdout
        for line in ("#PBS -l select=2:ncpus=64:ngpus=1:mpiprocs=1", "#PBS -l place=scatter", "#PBS -A UABC0001",
                     "#PBS -q main", "#PBS -l walltime=00:10:00", "#PBS -j oe", "module load cuda",
                     "export NCCL_SOCKET_IFNAME=hsn", "export NCCL_IB_DISABLE=1", f"cd {workdir}"):
            assert f"\n{line}\n" in script, script
        assert "mpiexec -n 2 --ppn 1 --cpu-bind none" in script, script
        assert not (workdir / "nodescale-jobs").exists()

    def submitted(command, result):
        job = ran["job"]
        assert sorted(job.daemons) == ["127.0.0.2", "127.0.0.3"], job.output  # one torchrun per node
        assert "training on cpu, world size 2\n" in job.output, job.output
        assert job.output_file is not None and job.output_file.parent == workdir / "nodescale-jobs"

    def log(command, result):
        assert result.stdout == ran["job"].output_file.read_text()
        assert JOB_EPOCH_LINE.search(result.stdout), result.stdout
        assert saved(workdir / "model.pt")["world_size"] == 2

    dry = "nodescale launch --cluster derecho --nodes 2 --gpus-per-node 1 --account UABC0001 --time 00:10:00 --dry-run"
    run_step(5, workdir, environment, {"nodescale launch --cluster derecho": submitted, dry: dry_run,
                                       "cat nodescale-jobs/nodescale.o": log}, replace)
    assert "job" in ran, "step 5 never ran the job"


def test_step6_builtin_train(workdir: Path, environment: dict[str, str]) -> None:
    def train(command, result):
        assert "validation accuracy" in result.stdout, result.stdout
        summary = read_summary(workdir / "runs" / "builtin")
        assert summary["world_size"] == 2 and summary["val_accuracy"] > 0.8, summary

    run_step(6, workdir, environment, {"nodescale train": train})
