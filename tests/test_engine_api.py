"""The library face of the engine: a user's script (tests/api_scripts/train_mlp.py) under real launchers.

One module fixture trains the script once per layout and strategy; the tests compare
what those runs wrote. The loader's sample accounting is checked without processes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, cli_env, max_difference, read_metrics, read_summary, weights_as_saved

SCRIPT = REPO / "tests" / "api_scripts" / "train_mlp.py"
# SGD at lr 0.1 on an MLP without BatchNorm: runs that sum the same gradients in another order
# (FSDP's reduce-scatter, one rank's batch of 24 against two of 12) differ by float32 rounding,
# ~1e-7 relative per step, over 26 steps on weights of size ~0.3: far below this bound.
TOLERANCE = 1e-5
# Every run clips the global gradient norm to this. Norms above it occur (clipping is at work: the
# weights end ~1.5e-2 elsewhere without it), so equal weights mean every strategy clipped alike.
CLIP = 0.3


def launch(nproc: int, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """The script under ``python`` (1) or ``torchrun`` (several); fails the test if it fails."""
    command = [sys.executable, str(SCRIPT), *args]
    if nproc > 1:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    result = subprocess.run(command, cwd=cwd, env=env or cli_env(), capture_output=True, text=True, timeout=240)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result.stdout


def result(run_dir: Path) -> dict:
    return torch.load(run_dir / "result.pt", weights_only=True)


def resumed_copy(run_dir: Path, step: int, target: Path) -> Path:
    (target / "checkpoints").mkdir(parents=True)
    for path in (run_dir / "checkpoints").glob(f"step-{step:08d}*"):
        (shutil.copytree if path.is_dir() else shutil.copy)(path, target / "checkpoints" / path.name)
    return target


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """26 SGD steps over 301 samples (global batch 24), saved at step 10, in every layout."""
    root = tmp_path_factory.mktemp("api")
    clip = ["--clip", str(CLIP)]
    launch(2, [*clip, "--batch-size", "12", "--save-at", "10", "--out", str(root / "ddp2")], root)
    launch(2, [*clip, "--strategy", "fsdp", "--batch-size", "12", "--save-at", "10", "--out", str(root / "fsdp2")],
           root)
    launch(1, [*clip, "--batch-size", "24", "--out", str(root / "single1")], root)
    launch(2, [*clip, "--strategy", "deepspeed", "--batch-size", "12", "--save-at", "10", "--out", str(root / "zero2")],
           root)
    # Resume from FSDP's sharded step-10 checkpoint on 1 rank and from DDP's full one on 3.
    resumed_copy(root / "fsdp2", 10, root / "resumed1")
    launch(1, [*clip, "--strategy", "fsdp", "--batch-size", "24", "--resume", "--out", str(root / "resumed1")], root)
    resumed_copy(root / "ddp2", 10, root / "resumed3")
    launch(3, [*clip, "--batch-size", "8", "--resume", "--out", str(root / "resumed3")], root)
    # DeepSpeed resumes its own partitions on the world size that wrote them.
    resumed_copy(root / "zero2", 10, root / "resumed-zero2")
    launch(2, [*clip, "--strategy", "deepspeed", "--batch-size", "12", "--resume", "--out",
               str(root / "resumed-zero2")], root)
    return {path.name: path for path in root.iterdir()}


pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("name", ["fsdp2", "zero2"])
def test_fsdp_and_deepspeed_clip_and_end_with_the_weights_of_ddp(runs: dict[str, Path], name: str) -> None:
    assert result(runs["ddp2"])["largest_norm"] > CLIP  # clipping was at work
    if name == "fsdp2":  # FSDP's norm is reduced over the shards: the same global norm as DDP's
        assert result(runs[name])["largest_norm"] == pytest.approx(result(runs["ddp2"])["largest_norm"], rel=1e-5)
    assert max_difference(result(runs[name])["weights"], result(runs["ddp2"])["weights"]) < TOLERANCE
    # Evaluation with every rank in every (sharded) forward counts each validation sample once.
    assert result(runs[name])["val_samples"] == 97
    assert result(runs[name])["val_accuracy"] == pytest.approx(result(runs["ddp2"])["val_accuracy"], abs=1 / 97)
    assert read_summary(runs[name])["strategy"] == {"fsdp2": "fsdp", "zero2": "deepspeed"}[name]


def test_two_ranks_of_half_the_batch_train_as_one_rank_of_all(runs: dict[str, Path]) -> None:
    two, one = result(runs["ddp2"]), result(runs["single1"])
    assert two["steps"] == one["steps"] == 26  # 13 global batches per epoch, the last one of 13 samples
    assert max_difference(two["weights"], one["weights"]) < TOLERANCE
    assert two["val_samples"] == one["val_samples"] == 97  # evaluation counts every sample once
    assert two["val_accuracy"] == one["val_accuracy"]


@pytest.mark.parametrize("name", ["resumed1", "resumed3", "resumed-zero2"])
def test_two_rank_checkpoints_resume_on_one_rank_on_three_and_under_zero(runs: dict[str, Path], name: str) -> None:
    resumed, whole = result(runs[name]), result(runs["ddp2"])
    assert resumed["steps"] == 26
    # It trained steps 11-26 only, and ends where the whole run ended: weights, optimiser and the
    # loader's place (the same global batch: mid-epoch, at the same sample) were all restored.
    logged = [r["step"] for r in read_metrics(runs[name]) if r["kind"] == "step" and "loss" in r]
    assert logged == list(range(11, 27))
    assert max_difference(resumed["weights"], whole["weights"]) < TOLERANCE
    summary = read_summary(runs[name])
    assert summary["world_size"] == int(name[-1]) and summary["global_steps"] == 26
    assert summary["strategy"] == {"resumed1": "fsdp", "resumed3": "ddp", "resumed-zero2": "deepspeed"}[name]


def test_the_summary_counts_every_ranks_samples(runs: dict[str, Path]) -> None:
    summary = read_summary(runs["ddp2"])
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 24 and summary["epochs_completed"] == 2
    # After 5 warm-up steps, 21 steps: 8 of the first epoch's 13 and all 13 of the second (301 - 288 = 13 in
    # the last), counted on both ranks.
    assert summary["timed_steps"] == 21 and summary["timed_samples"] == 7 * 24 + 13 + 12 * 24 + 13
    assert summary["samples_per_second"] > 0 and summary["state_bytes_per_rank"]["total_bytes"] > 0
    assert summary["val_accuracy"] == result(runs["ddp2"])["val_accuracy"]
    steps = [r for r in read_metrics(runs["ddp2"]) if r["kind"] == "step" and "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 27))
    assert (runs["ddp2"] / "metrics.csv").is_file() and (runs["ddp2"] / "config.yaml").is_file()


def test_an_api_checkpoint_exports_to_a_plain_state_dict(runs: dict[str, Path], tmp_path: Path) -> None:
    from nodescale.train.export import consolidated_model_state, resolve

    exports = {}
    for name, layout in (("ddp2", ".pt"), ("fsdp2", ""), ("zero2", "")):  # a full file, DCP's and DeepSpeed's
        path = resolve(runs[name])
        assert path.name == f"step-00000010{layout}"
        exports[name] = consolidated_model_state(path)
        assert set(exports[name]) == set(result(runs[name])["weights"])
        # The values the files hold, as torch.load, DCP and DeepSpeed's zero_to_fp32 read them themselves.
        saved = weights_as_saved(path)
        assert exports[name].keys() == saved.keys()
        assert all(torch.equal(exports[name][k], saved[k]) for k in saved), name
    # The three runs are one run's arithmetic in another layout (as their final weights): so are their step 10s.
    assert max_difference(exports["fsdp2"], exports["ddp2"]) < TOLERANCE
    assert max_difference(exports["zero2"], exports["ddp2"]) < TOLERANCE


def test_sigterm_to_one_rank_stops_every_rank_with_a_checkpoint_and_exit_code_3(tmp_path: Path) -> None:
    from nodescale.distributed.ports import free_port

    port = str(free_port("127.0.0.1"))
    args = [sys.executable, str(SCRIPT), "--epochs", "50", "--sleep", "0.05", "--out", str(tmp_path / "run")]
    workers = []
    for rank in range(2):
        env = {**cli_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODESCALE_REQUEUE_FILE": str(tmp_path / "marker")}
        workers.append(subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _steps_logged(tmp_path / "run", 8):
            time.sleep(0.2)
        os.kill(workers[1].pid, signal.SIGTERM)
        outputs = [worker.communicate(timeout=120)[0] for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    assert [worker.returncode for worker in workers] == [3, 3], outputs
    stopped = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["signal"] == "SIGTERM"
    step = stopped[0]["step"]
    assert (tmp_path / "run" / "checkpoints" / f"step-{step:08d}.pt").is_file()
    assert (tmp_path / "marker").read_text().splitlines() == [f"step={step}", f"run_dir={tmp_path / 'run'}"]
    output = launch(2, ["--epochs", "2", "--resume", "--out", str(tmp_path / "run")], tmp_path)
    assert f"(step {step})" in output
    assert result(tmp_path / "run")["steps"] == 2 * 19  # two epochs of 301 samples in global batches of 16


def test_a_rank_that_stops_stepping_is_named_by_the_watchdog(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
               "--epochs", "50", "--stall-at", "3", "--heartbeat", "4", "--out", str(tmp_path / "run")]
    began = time.monotonic()
    run = subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and time.monotonic() - began < 60, run.stderr[-2000:]
    assert "rank 1" in run.stderr and "made no progress" in run.stderr and "last step 3" in run.stderr, run.stderr


def _steps_logged(run_dir: Path, at_least: int) -> bool:
    try:
        return sum(1 for r in read_metrics(run_dir) if r["kind"] == "step") >= at_least
    except (OSError, ValueError):
        return False


def _drawn(size: int, world: int, batch: int, pad: bool = True) -> list[list[tuple[list[int], int]]]:
    """Per rank, the (sample ids, real_count) of each batch of epoch 0."""
    from torch.utils.data import TensorDataset

    from nodescale.data.epoch_loader import EpochLoader
    from nodescale.data.sharding import ShardPlan

    dataset = TensorDataset(torch.arange(size))
    ranks = []
    for rank in range(world):
        loader = EpochLoader(dataset, ShardPlan(size, world, rank, batch, seed=1), pad=pad, drop_last=False,
                             grad_accum=1, device=torch.device("cpu"))
        ranks.append([(ids.tolist(), loader.real_count) for (ids,) in loader])
    return ranks


@pytest.mark.parametrize("batch", [32, 5])
def test_a_loader_of_1501_samples_on_two_ranks_yields_each_sample_once(batch: int) -> None:
    ranks = _drawn(1501, 2, batch)
    real = sorted(i for rank in ranks for ids, count in rank for i in ids[:count])
    assert real == list(range(1501))
    assert len(ranks[0]) == len(ranks[1])  # the ranks stay in step
    if batch == 5:  # 751 and 750 samples: rank 1 would be a whole step short, and gets one padding sample
        assert ranks[1][-1][1] == 0 and len(ranks[1][-1][0]) == 1
        assert _drawn(1501, 2, 5, pad=False)[1][-1][1] == 5  # pad=False: only its own samples


def test_the_loader_resumes_at_the_same_sample_with_the_same_global_batch() -> None:
    from torch.utils.data import TensorDataset

    from nodescale.data.epoch_loader import EpochLoader
    from nodescale.data.sharding import ShardPlan

    dataset = TensorDataset(torch.arange(100))

    def loader(world: int, rank: int, batch: int) -> EpochLoader:
        return EpochLoader(dataset, ShardPlan(100, world, rank, batch, seed=2), pad=True, drop_last=False,
                           grad_accum=1, device=torch.device("cpu"))

    first = loader(2, 0, 5)
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    saved = first.state_dict()
    rest_of_two = sorted(i for rank in range(2) for (ids,) in _resumed(loader(2, rank, 5), saved) for i in ids.tolist())
    one = loader(1, 0, 10)
    assert sorted(i for (ids,) in _resumed(one, saved) for i in ids.tolist()) == rest_of_two  # same samples next
    other = loader(1, 0, 7)  # another global batch: the next epoch, from its start
    with pytest.warns(UserWarning, match="start of epoch 1"):
        other.load_state_dict(saved)
    assert (other.epoch, other.batch_in_epoch) == (1, 0)


def _resumed(loader, state):  # noqa: ANN001, ANN202
    loader.load_state_dict(state)
    return list(loader)


def test_an_unfinished_iteration_does_not_move_the_next_epoch() -> None:
    from torch.utils.data import TensorDataset

    from nodescale.data.epoch_loader import EpochLoader
    from nodescale.data.sharding import ShardPlan

    loader = EpochLoader(TensorDataset(torch.arange(10)), ShardPlan(10, 1, 0, 4, shuffle=False), pad=True,
                         drop_last=False, grad_accum=1, device=torch.device("cpu"))
    assert len(next(iter(loader))[0]) == loader.batch_size == 4  # a peek at the batch size, as scripts do
    assert [ids.tolist() for (ids,) in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert loader.epoch == 1 and len(loader.dataset) == 10


def test_tensors_in_memory_are_cut_a_batch_at_a_time_with_the_dataloaders_values() -> None:
    from torch.utils.data import TensorDataset

    from nodescale.data.epoch_loader import EpochLoader
    from nodescale.data.sharding import ShardPlan

    dataset = TensorDataset(torch.randn(50, 3), torch.arange(50))
    fast, slow = (EpochLoader(dataset, ShardPlan(50, 2, 1, 8, seed=3), pad=True, drop_last=False, grad_accum=1,
                              device=torch.device("cpu"), **options) for options in ({}, {"num_workers": 0}))
    assert fast._cut is not None and slow._cut is None
    pairs = list(zip(fast, slow, strict=True))
    assert len(pairs) == 4 and all(torch.equal(a, b) for one, other in pairs for a, b in zip(one, other, strict=True))
