"""Real training runs: DDP on 2 gloo ranks against one process, resume, summaries.

Every test here starts real processes through the real CLI (nodescale's own
launcher, which is torch's elastic agent, or an external torchrun).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from conftest import cli_env, final_weights, max_difference, read_metrics, read_summary, run_cli

if TYPE_CHECKING:
    from engine_runs import TwoRankRun

pytestmark = pytest.mark.multiproc
pytest_plugins = ["engine_runs"]  # uninterrupted_two_rank_run, shared with test_restarts

# Constant learning rate and plain SGD: differences between runs stay the
# size of float rounding instead of being rescaled by Adam's normaliser.
SGD = ["--optimizer", "sgd", "--lr", "0.05", "--set", "optim.schedule=constant", "--no-progress"]


@pytest.fixture(scope="module")
def equivalence_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same 12 steps of cnn on digits: 2 ranks x batch 16, 1 rank x 32, single-process x 32."""
    root = tmp_path_factory.mktemp("equivalence")
    common = ["--max-steps", "12", "--seed", "3", *SGD]
    runs = {
        "ddp2": ["--nproc", "2", "--batch-size", "16", "--sync-batchnorm"],
        "ddp1": ["--nproc", "1", "--batch-size", "32"],
        "single": ["--strategy", "single", "--batch-size", "32"],
    }
    for name, args in runs.items():
        run_cli(["train", *common, *args, "--out", str(root / name)], cwd=root)
    return {name: root / name for name in runs}


def test_ddp_two_ranks_half_batch_equals_one_rank_full_batch(equivalence_runs: dict[str, Path]) -> None:
    # Tolerance: SyncBatchNorm reduces sums across ranks in another order than
    # BatchNorm over one batch; after 12 SGD steps that leaves ~1e-6.
    two = final_weights(equivalence_runs["ddp2"])
    one = final_weights(equivalence_runs["ddp1"])
    single = final_weights(equivalence_runs["single"])
    assert max_difference(two, one) < 1e-4
    assert max_difference(one, single) < 1e-6


def test_validation_is_aggregated_over_all_ranks(equivalence_runs: dict[str, Path]) -> None:
    two, one = read_summary(equivalence_runs["ddp2"]), read_summary(equivalence_runs["ddp1"])
    assert two["world_size"] == 2 and one["world_size"] == 1
    # 359 validation samples do not split evenly over 2 ranks: each is counted once.
    assert two["val_samples"] == one["val_samples"] == 359
    assert two["val_accuracy"] == pytest.approx(one["val_accuracy"], abs=1 / 359)
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-3)


def test_uneven_last_batch_gives_the_exact_global_mean(tmp_path: Path) -> None:
    # 101 samples: the epoch's last step holds 5 real samples over 2 ranks and padding.
    # A model without BatchNorm makes the weighted loss the only thing under test.
    common = ["--model", "toy", "--dataset", "regression", "--set", "data.samples=101", "--epochs", "2", *SGD]
    run_cli(["train", *common, "--nproc", "2", "--batch-size", "8", "--out", "two"], cwd=tmp_path)
    run_cli(["train", *common, "--strategy", "single", "--batch-size", "16", "--out", "one"], cwd=tmp_path)
    assert max_difference(final_weights(tmp_path / "two"), final_weights(tmp_path / "one")) < 1e-6
    assert read_summary(tmp_path / "two")["val_accuracy"] is None  # regression has no accuracy


def test_resume_ends_with_the_same_weights_as_an_uninterrupted_run(uninterrupted_two_rank_run: TwoRankRun,
                                                                   tmp_path: Path) -> None:
    full, args = uninterrupted_two_rank_run.path, uninterrupted_two_rank_run.args
    # Step 280 is mid-epoch (23 steps per epoch): the sampler position must be restored too. (The last
    # checkpoint but one: 20 steps to train, not 280.)
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "checkpoints/step-00000280.pt", tmp_path / "resumed/checkpoints/")
    result = run_cli([*args, "--out", "resumed", "--resume"], cwd=tmp_path)
    assert "resumed from" in result.stdout
    assert max_difference(final_weights(full), final_weights(tmp_path / "resumed")) == 0.0
    assert read_summary(tmp_path / "resumed")["global_steps"] == 300

    # The same step in the layout nodescale train wrote before its loop ran on the library's calls
    # (scheduler and position at the top, no "api" entry): old runs resume, on the same weights.
    from nodescale.engine import checkpoint_files as checkpoint

    state = torch.load(full / "checkpoints/step-00000280.pt", weights_only=True)
    state["scheduler"] = state.pop("api")["stateful"]["scheduler"]
    checkpoint.save(tmp_path / "legacy", 280, state, 5)
    run_cli([*args, "--out", "legacy", "--resume"], cwd=tmp_path)
    assert max_difference(final_weights(full), final_weights(tmp_path / "legacy")) == 0.0


def test_runs_unchanged_under_torchrun_and_the_one_epoch_summary_is_right(tmp_path: Path) -> None:
    # One run for both: the summary is the workers' own, whichever launcher started them.
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "nodescale", "train", "--epochs", "1", "--no-progress", "--out", "run"],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr
    summary = read_summary(tmp_path / "run")
    assert summary["world_size"] == 2 and summary["global_steps"] == 23
    assert summary["epochs_completed"] == 1 and len(summary["epoch_seconds"]) == 1
    assert summary["average_epoch_seconds"] == pytest.approx(summary["epoch_seconds"][0], rel=1e-3)
    assert summary["average_epoch_excludes_first"] is False
    # 1,438 training samples, 64 per step over 2 ranks, the first 5 steps are warm-up:
    # the throughput counts exactly what both ranks processed after that.
    assert summary["timed_samples"] == 1438 - 5 * 64
    assert summary["timed_steps"] == 23 - 5
    assert len(summary["samples_per_second_by_rank"]) == 2
    assert summary["samples_per_second"] == pytest.approx(summary["timed_samples"] / (
        summary["step_seconds"] * summary["timed_steps"]), rel=1e-6)
    for key in ("world_size", "strategy", "samples_per_second", "val_loss", "val_accuracy", "wall_seconds"):
        assert summary[key] is not None
    kinds = [record["kind"] for record in read_metrics(tmp_path / "run")]
    assert kinds.count("epoch") == 1 and "step" in kinds
    assert "(the only epoch)" in result.stdout and "samples/s" in result.stdout


def test_default_job_reaches_95_percent_within_a_minute(tmp_path: Path) -> None:
    # The README's first command: `nodescale train` with no arguments.
    run_cli(["train"], cwd=tmp_path)
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["model"] == "cnn" and summary["dataset"] == "digits"
    assert summary["val_accuracy"] >= 0.95
    assert summary["wall_seconds"] < 60


def test_dp_strategy_warns_and_trains(tmp_path: Path) -> None:
    result = run_cli(["train", "--strategy", "dp", "--max-steps", "3", "--out", "run"], cwd=tmp_path)
    assert "slower than DDP" in result.stderr
    assert read_summary(tmp_path / "run")["world_size"] == 1


def test_reusing_a_run_directory_needs_resume_and_resume_keeps_the_run_settings(tmp_path: Path) -> None:
    run_cli(["train", "--strategy", "single", "--max-steps", "2", "--no-progress", "--out", "run"], cwd=tmp_path)
    before = (tmp_path / "run" / "config.yaml").read_text()
    result = run_cli(["train", "--strategy", "single", "--max-steps", "2", "--out", "run"], cwd=tmp_path,
                     check=False)
    assert result.returncode == 2
    assert "already holds a run" in result.stderr and "--resume" in result.stderr
    assert "Traceback" not in result.stderr
    # With --resume, another model is refused, and the run's settings stay as they were.
    result = run_cli(["train", "--strategy", "single", "--model", "resnet18", "--max-steps", "4", "--no-progress",
                      "--out", "run", "--resume"], cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert "model.name was 'cnn', now 'resnet18'" in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "run" / "config.yaml").read_text() == before


def test_missing_data_dir_fails_before_any_process_starts(tmp_path: Path) -> None:
    result = run_cli(["train", "--dataset", "mnist", "--data-dir", str(tmp_path / "nope")], cwd=tmp_path,
                     check=False)
    assert result.returncode == 2
    assert "nope" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


def test_checkpoint_holds_the_whole_training_state(uninterrupted_two_rank_run: TwoRankRun) -> None:
    from nodescale.engine.checkpoint_files import list_checkpoints

    steps = {step: path for step, path in list_checkpoints(uninterrupted_two_rank_run.path)}
    state = torch.load(steps[20], weights_only=True)
    assert {"model", "optimizer", "api", "updater", "position", "rng", "config"} <= state.keys()
    assert {"scheduler", "loader"} <= state["api"]["stateful"].keys()  # what the loop named beside them
    assert state["api"]["stateful"]["loader"]["batch_in_epoch"] == 20
    assert "scaler" in state["updater"]  # the fp16 loss scale
    assert state["position"]["global_step"] == 20 and len(state["rng"]) == 2
    assert state["optimizer"]["state"], "optimiser moments must be saved"


def test_a_data_error_found_by_the_workers_is_reported_once_and_blocks_nothing(tmp_path: Path) -> None:
    import struct

    data = tmp_path / "mnist"
    data.mkdir()
    for name, magic, shape in [("train-images-idx3-ubyte", 2051, (100, 28, 28)),
                               ("train-labels-idx1-ubyte", 2049, (100,)),
                               ("t10k-images-idx3-ubyte", 2051, (20, 28, 28)),
                               ("t10k-labels-idx1-ubyte", 2049, (20,))]:
        size = 1
        for dim in shape:
            size *= dim
        header = struct.pack(">I", magic) + b"".join(struct.pack(">I", dim) for dim in shape)
        (data / name).write_bytes(header + bytes(size))
    images = data / "train-images-idx3-ubyte"
    whole = images.read_bytes()
    images.write_bytes(whole[:5000])  # truncated: only the loaders in the workers can tell
    args = ["train", "--dataset", "mnist", "--data-dir", str(data), "--max-steps", "2", "--no-progress",
            "--out", "run"]
    result = run_cli(args, cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert result.stderr.count("is truncated") == 1 and "ranks 0, 1" in result.stderr
    assert "Traceback" not in result.stderr and "exitcode" not in result.stderr
    images.write_bytes(whole)
    run_cli(args, cwd=tmp_path)  # the failed attempt left nothing that makes the rerun need --resume


def test_resume_on_another_world_size_continues(uninterrupted_two_rank_run: TwoRankRun, tmp_path: Path) -> None:
    # Saved by 2 ranks x 32 at step 20, resumed by 1 rank x 64: the same global batch, mid-epoch.
    run = tmp_path / "run"
    shutil.copytree(uninterrupted_two_rank_run.path, run)
    for path in (run / "checkpoints").glob("step-*"):
        if not path.name.startswith("step-00000020."):
            path.unlink()
    result = run_cli(["train", "--nproc", "1", "--batch-size", "64", "--max-steps", "40", "--no-progress",
                      "--out", "run", "--resume"], cwd=tmp_path)
    assert "mid-epoch" not in result.stderr  # the same global batch: the loader continues where it was
    summary = read_summary(run)
    assert summary["world_size"] == 1 and summary["global_steps"] == 40
    records = [r for r in read_metrics(run) if r["kind"] == "checkpoint"]
    # The first run's checkpoints, then the resumed run's.
    assert [r["step"] for r in records] == [*uninterrupted_two_rank_run.checkpoint_steps, 40]


def test_the_final_step_is_saved_once(uninterrupted_two_rank_run: TwoRankRun) -> None:
    # --max-steps 300 is a multiple of --checkpoint-every 20: the last periodic save is the final one.
    steps = [r["step"] for r in read_metrics(uninterrupted_two_rank_run.path) if r["kind"] == "checkpoint"]
    assert steps == uninterrupted_two_rank_run.checkpoint_steps == list(range(20, 301, 20))


@pytest.mark.slow
def test_compile_and_channels_last_train_the_same_weights_as_eager(tmp_path: Path) -> None:
    toy = ["--strategy", "single", "--model", "toy", "--dataset", "regression", "--max-steps", "4", *SGD]
    run_cli(["train", *toy, "--out", "eager"], cwd=tmp_path)
    run_cli(["train", *toy, "--compile", "--out", "compiled"], cwd=tmp_path)
    # Inductor fuses and reorders float operations: equal up to rounding, not bit for bit.
    assert max_difference(final_weights(tmp_path / "eager"), final_weights(tmp_path / "compiled")) < 1e-5
    cnn = ["--strategy", "single", "--max-steps", "4", *SGD]
    run_cli(["train", *cnn, "--out", "nchw"], cwd=tmp_path)
    run_cli(["train", *cnn, "--channels-last", "--out", "nhwc"], cwd=tmp_path)
    assert max_difference(final_weights(tmp_path / "nchw"), final_weights(tmp_path / "nhwc")) < 1e-5


def test_two_rank_run_keeps_its_labelled_lines(uninterrupted_two_rank_run: TwoRankRun) -> None:
    """The forked ranks' output goes through the local launcher's labels into the run's ranks.log."""
    lines = (uninterrupted_two_rank_run.path / "ranks.log").read_text().splitlines()
    assert lines[0].startswith("nodescale: launch at "), lines[:3]  # each launch headed: a resume appends
    assert lines[1].startswith("nodescale: the local launcher places 2 task(s)"), lines[:3]
    assert any(line.startswith("[rank0]: ") for line in lines), lines[:20]
    assert all(line.startswith(("[rank0]: ", "[rank1]: ")) for line in lines[2:]), lines[:20]
