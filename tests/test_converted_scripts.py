"""Two well-known single-GPU scripts and their nodescale versions (examples/mnist, examples/ddp_tutorial).

Each single-process script runs once; each distributed one runs as plain ``python`` (one
process) and with two processes under ``torchrun``, ``srun`` on the local Slurm cluster and Open
MPI's ``mpiexec``. What proves a run was distributed and right: the steps per epoch shrink with
the world size (each rank trains on its share), the test totals cover the 360 test samples
exactly once (a rank alone sees about half), only rank 0 prints, the model or checkpoint is
written once, and the accuracy is well above chance (10%).
"""

from __future__ import annotations

import json
import math
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, cli_env, free_port
from scheduler_fixtures import MPIEXEC, SlurmCluster, require

MNIST = REPO / "examples" / "mnist"
DDP_TUTORIAL = REPO / "examples" / "ddp_tutorial"
TRAIN_SAMPLES, TEST_SAMPLES = 1797 - 360, 360  # the scripts hold out 360 digits
BATCH = 32  # per process
FLOOR = 0.6  # one epoch reaches 70-90%; a wrong loss scale or a rank training alone falls far below
LAUNCHERS = ["python", "torchrun", "srun", "mpiexec"]
PROCESSES = {"python": 1, "torchrun": 2, "srun": 2, "mpiexec": 2}

MNIST_ARGS = ["--epochs", "1", "--batch-size", str(BATCH), "--log-interval", "1000", "--save-model"]
DDP_ARGS = ["1", "1", "--batch_size", str(BATCH)]  # one epoch, a checkpoint after it


def launch(launcher: str, script: Path, args: list[str], cwd: Path, slurm: SlurmCluster | None = None,
           nodes: int = 1) -> subprocess.CompletedProcess[str]:
    """``script args`` in ``cwd`` started by ``launcher``; fails the test with its output if it failed."""
    env = cli_env()
    command = [sys.executable, str(script), *args]
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   *command[1:]]
    elif launcher == "mpiexec":
        binary = require([MPIEXEC["openmpi"]], "the mpiexec launch")[MPIEXEC["openmpi"]]
        command = [binary, "-n", "2", "--oversubscribe", "--allow-run-as-root", *command]
        env["MASTER_PORT"] = str(free_port())  # not the default 29500, which another test's mpiexec may hold
    elif launcher == "srun":
        assert slurm is not None
        require(["srun"], "the srun launch")
        env.update(slurm.env)
        if nodes > 1:  # node1 and node2 are names only this cluster knows; rank 0 listens on loopback
            env["MASTER_ADDR"] = "127.0.0.1"
        command = ["srun", f"--nodes={nodes}", "--ntasks=2", f"--chdir={cwd}", "--time=5", *command]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {result.returncode}\n--- stdout\n{result.stdout}\n"
                    f"--- stderr\n{result.stderr[-4000:]}", pytrace=False)
    return result


@pytest.fixture
def cluster(request: pytest.FixtureRequest, launcher: str) -> SlurmCluster | None:
    # Only the srun runs start (or reuse) the session's Slurm cluster.
    return request.getfixturevalue("slurm_cluster") if launcher == "srun" else None


def mnist_test_totals(stdout: str) -> tuple[int, int]:
    """(correct, seen) of the one test line; more than one line means more than rank 0 printed."""
    lines = re.findall(r"Accuracy: (\d+)/(\d+)", stdout)
    assert len(lines) == 1, stdout
    return int(lines[0][0]), int(lines[0][1])


def assert_mnist_model(path: Path, script: Path) -> None:
    net = runpy.run_path(str(script))["Net"]()
    net.load_state_dict(torch.load(path, weights_only=True))  # strict: a plain, unwrapped state dict
    assert not [p for p in path.parent.iterdir() if p.name != path.name and "mnist_cnn" in p.name]


def test_mnist_single_process(tmp_path: Path) -> None:
    result = launch("python", MNIST / "main_single.py", MNIST_ARGS, tmp_path)
    correct, seen = mnist_test_totals(result.stdout)
    assert seen == TEST_SAMPLES and correct / seen > FLOOR, result.stdout
    assert_mnist_model(tmp_path / "mnist_cnn.pt", MNIST / "main_single.py")


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_mnist_distributed(launcher: str, cluster: SlurmCluster | None, tmp_path: Path) -> None:
    world = PROCESSES[launcher]
    # srun: both tasks on one node, so nodescale must find rank 0 on loopback by itself.
    result = launch(launcher, MNIST / "main_distributed.py", MNIST_ARGS, tmp_path, cluster, nodes=1)
    steps = math.ceil(TRAIN_SAMPLES / (BATCH * world))
    # One training line (rank 0's) whose batch count is this rank's share of the epoch.
    assert re.findall(r"Train Epoch: 1 \[0/(\d+) batches\]", result.stdout) == [str(steps)], result.stdout
    correct, seen = mnist_test_totals(result.stdout)
    assert seen == TEST_SAMPLES, result.stdout  # summed over ranks: every test sample exactly once
    assert correct / seen > FLOOR, result.stdout
    assert_mnist_model(tmp_path / "mnist_cnn.pt", MNIST / "main_distributed.py")


def ddp_accuracy(stdout: str) -> tuple[int, int]:
    lines = re.findall(r"Epoch 0 \| Test accuracy: (\d+)/(\d+)", stdout)
    assert len(lines) == 1, stdout
    return int(lines[0][0]), int(lines[0][1])


def test_ddp_tutorial_single_process(tmp_path: Path) -> None:
    result = launch("python", DDP_TUTORIAL / "single_gpu.py", DDP_ARGS, tmp_path)
    assert f"Steps: {math.ceil(TRAIN_SAMPLES / BATCH)}" in result.stdout, result.stdout
    correct, seen = ddp_accuracy(result.stdout)
    assert seen == TEST_SAMPLES and correct / seen > FLOOR, result.stdout
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["weight"].shape == (10, 64)


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_ddp_tutorial_distributed(launcher: str, cluster: SlurmCluster | None, tmp_path: Path) -> None:
    world = PROCESSES[launcher]
    # srun: one task on each of the cluster's two nodes (the mnist test puts both on one).
    result = launch(launcher, DDP_TUTORIAL / "nodescale_gpu.py", DDP_ARGS, tmp_path, cluster, nodes=2)
    steps = math.ceil(TRAIN_SAMPLES / (BATCH * world))
    assert re.findall(r"Epoch 0 \| Batchsize: 32 \| Steps: (\d+)", result.stdout) == [str(steps)], result.stdout
    correct, seen = ddp_accuracy(result.stdout)
    assert seen == TEST_SAMPLES, result.stdout  # summed over ranks: every test sample exactly once
    assert correct / seen > FLOOR, result.stdout
    saved = re.findall(r"Training checkpoint saved at (\S+)", result.stdout)
    run = tmp_path / "ddp_run"
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved == [str(run / "checkpoints" / f"step-{steps:08d}.pt")], result.stdout
    assert checkpoints == [f"step-{steps:08d}.manifest.json", f"step-{steps:08d}.pt"]
    checkpoint = torch.load(saved[0], weights_only=False)
    assert checkpoint["world_size"] == world and checkpoint["position"]["global_step"] == steps
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == world and summary["global_steps"] == steps
