"""``nodescale train`` observed: metric loggers, the monitor and the profiler in a real 2-rank run.

One run with everything switched on is shared by the tests: what each logger
wrote is read back through its own library, and only rank 0 wrote it.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import once_more_if_torch_crashed, read_metrics, read_summary, run_cli

# Batch 64 x 2 ranks: 12 steps per epoch of the digits, so the run logs one epoch and goes on.
STEPS, LOG_EVERY, PROFILE = 14, 3, (3, 2)


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("observed")
    patch = pytest.MonkeyPatch()
    patch.delenv("MLFLOW_TRACKING_URI", raising=False)
    patch.delenv("WANDB_MODE", raising=False)
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        patch.setenv(name, str(root / "wandb-home"))  # nothing in $HOME

    def attempt(number: int) -> subprocess.CompletedProcess[str]:
        return run_cli(["train", "--nproc", "2", "--model", "cnn", "--batch-size", "64", "--max-steps", str(STEPS),
                        "--log-every", str(LOG_EVERY),
                        "--log", "tensorboard,mlflow,wandb", "--monitor", "--monitor-interval", "0.2",
                        "--profile", f"{PROFILE[0]}:{PROFILE[1]}", "--no-progress", "--out", f"run{number}"], root,
                       timeout=280, check=False)

    try:
        run = once_more_if_torch_crashed(attempt)
    finally:
        patch.undo()
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    return root / run.args[-1]


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if r["kind"] == "step"]


@pytest.mark.multiproc
def test_step_records_carry_reduced_time_split_and_memory(observed_run: Path) -> None:
    steps = step_records(observed_run)
    numbers = [r["step"] for r in steps]
    assert set(range(LOG_EVERY, STEPS + 1, LOG_EVERY)) <= set(numbers) and numbers[-1] == STEPS
    assert numbers == sorted(set(numbers))
    for record in steps:
        assert record["memory_bytes"] > 10e6  # a Python process with torch: tens of MB at least
        assert record["step_seconds"] == pytest.approx(record["data_wait_seconds"] + record["compute_seconds"])


@pytest.mark.multiproc
def test_csv_rows_equal_the_jsonl_records(observed_run: Path) -> None:
    with open(observed_run / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    jsonl = [r for r in read_metrics(observed_run) if r["kind"] in ("step", "epoch")]
    assert [(row["kind"], int(row["step"])) for row in rows] == [(r["kind"], r["step"]) for r in jsonl]
    for row, record in zip(rows, jsonl, strict=True):
        if record["kind"] == "step":
            assert float(row["loss"]) == pytest.approx(record["loss"])
            assert float(row["samples_per_second"]) == pytest.approx(record["samples_per_second"])


@pytest.mark.multiproc
def test_tensorboard_holds_the_loss_curve_from_one_writer(observed_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((observed_run / "tensorboard").rglob("events.out.tfevents.*"))
    assert len(files) == 1, files  # rank 0 alone
    events = EventAccumulator(str(observed_run / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in step_records(observed_run)]
    val = [r for r in read_metrics(observed_run) if r["kind"] == "epoch"]
    assert len(val) == 1
    assert [(e.step, e.value) for e in events.Scalars("val/accuracy")] == [(val[0]["step"],
                                                                           pytest.approx(val[0]["val_accuracy"]))]
    final = events.Scalars("final/val_accuracy")
    assert [e.value for e in final] == [pytest.approx(read_summary(observed_run)["val_accuracy"])]


@pytest.mark.multiproc
def test_mlflow_has_one_finished_run_with_params_and_metrics(observed_run: Path) -> None:
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{observed_run / 'mlruns'}")
    experiment = client.get_experiment_by_name("nodescale")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # rank 0 alone
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["strategy.name"] == "ddp" and run.data.params["train.max_steps"] == str(STEPS)
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["loss"])) for r in
                                                    step_records(observed_run)]
    assert run.data.metrics["final/val_accuracy"] == pytest.approx(read_summary(observed_run)["val_accuracy"])


@pytest.mark.multiproc
def test_wandb_wrote_one_offline_run(observed_run: Path) -> None:
    runs = list((observed_run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # rank 0 alone
    assert list(runs[0].glob("run-*.wandb"))


@pytest.mark.multiproc
def test_monitor_sampled_the_node_while_it_trained(observed_run: Path) -> None:
    summary = read_summary(observed_run)
    assert summary["monitor"]["files"] == ["monitor/node-0.csv"]
    with open(observed_run / "monitor" / "node-0.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == summary["monitor"]["samples"] >= 2
    assert all(float(row["procs_rss_bytes"]) > 20e6 for row in rows)  # two training processes with torch
    assert summary["energy_joules"] is None  # a CPU reports none
    # What observing cost, as the run accounted it: some, and a small part of the training time.
    train_seconds = summary["wall_seconds"]
    assert 0 < summary["monitor"]["sampler_cpu_seconds"] < 0.2 * train_seconds
    assert 0 < summary["logger_seconds"] < 0.5 * train_seconds


@pytest.mark.multiproc
def test_profile_has_a_trace_and_an_operator_table_per_rank(observed_run: Path) -> None:
    summary = read_summary(observed_run)
    assert summary["profile"]["steps"] == [PROFILE[0], PROFILE[0] + PROFILE[1] - 1]
    for rank in (0, 1):
        trace = json.loads((observed_run / "profile" / f"rank{rank}.trace.json").read_text())
        assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
        ops = json.loads((observed_run / "profile" / f"rank{rank}.ops.json").read_text())
        assert ops and all(op["calls"] > 0 for op in ops)
        assert (observed_run / "profile" / f"rank{rank}.ops.txt").read_text().strip()


@pytest.mark.parametrize("logger,extra", [("wandb", "wandb"), ("mlflow", "mlflow"), ("tensorboard", "tensorboard")])
def test_a_missing_logger_package_names_the_extra(logger: str, extra: str, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from nodescale.cli.main import main

    monkeypatch.setitem(sys.modules, logger, None)  # what an environment without the package looks like to imports
    code = main(["train", "--log", logger, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and f"nodescale[{extra}]" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
