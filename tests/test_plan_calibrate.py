"""``plan --calibrate`` and ``launch --plan``: the calibration's arithmetic and both commands, in-process.

The calibration reads a run directory (summary.json and config.yaml, as ``nodescale train`` writes
them); here they are written by hand, so the measured step time is a known number and the fitted
efficiency can be checked by arithmetic. benchmarks/plan_calibration.py holds the calibration to
real ``bench scaling`` runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from pathlib import Path

import pytest

from nodescale.cli.main import main
from nodescale.config.load import dump_yaml, load_config
from nodescale.errors import UserError
from nodescale.models.spec import InputSpec
from nodescale.plan.calibrate import MeasuredRun, calibrate, read_run, run_step_time
from nodescale.plan.hardware import Hardware
from nodescale.plan.model_facts import measure_model
from nodescale.plan.step_time import Layout

HW = Hardware("test GPU", 40_000_000_000, 1e12, "fp32", {"any": 1.0}, {})
SPEC = InputSpec((1, 8, 8), 10)


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def a_run(root: Path, step_s: float, world_size: int = 2, model: str = "cnn") -> Path:
    """A run directory as train leaves it, with a chosen step time: 16 samples per process, SGD."""
    cfg = load_config(None, {"model.name": model, "train.batch_size": 16})
    run_dir = root / f"{model}-{world_size}-{step_s}"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    (run_dir / "summary.json").write_text(json.dumps({"world_size": world_size, "step_seconds": step_s,
                                                      "model": model}))
    return run_dir


def test_the_efficiency_is_what_makes_the_plan_say_the_measured_step(tmp_path: Path) -> None:
    run = read_run(a_run(tmp_path, 0.01) / "summary.json")
    facts = measure_model(run.cfg, SPEC)
    fit = calibrate(run, facts, HW, ranks_per_node=4)
    # By hand: 3 forward passes' FLOPs of 16 samples at the peak; a 2-rank all-reduce of fp32 gradients
    # moves 2 (n - 1) / n = 1 x their bytes over 1 GB/s.
    compute_at_peak = 3 * facts.forward_flops_per_sample * 16 / 1e12
    comm = 4 * facts.parameter_count / 1e9
    assert fit.comm_s == pytest.approx(comm)
    assert fit.efficiency == pytest.approx(compute_at_peak / (0.01 - comm))
    assert run_step_time(run, facts, HW, Layout(1, 2), fit.efficiency).total_s == pytest.approx(0.01)
    # The same compute on 4 ranks, and their all-reduce: 2 x 3/4 of the gradients' bytes.
    four = run_step_time(run, facts, HW, Layout(1, 4), fit.efficiency)
    assert four.total_s == pytest.approx(0.01 - comm + 1.5 * comm)


def test_a_step_the_plan_cannot_explain_is_refused(tmp_path: Path) -> None:
    run = read_run(a_run(tmp_path, 1e-5))  # shorter than the all-reduce alone (58 us)
    with pytest.raises(UserError, match="no compute time"):
        calibrate(run, measure_model(run.cfg, SPEC), HW, 4)
    alone = read_run(a_run(tmp_path, 1e-9, world_size=1))  # faster than the peak
    with pytest.raises(UserError, match="faster than the peak"):
        calibrate(alone, measure_model(alone.cfg, SPEC), HW, 4)


PLAN = ["plan", "--sample-shape", "1,8,8", "--num-classes", "10", "--train-samples", "1797", "--gpus-per-node", "4",
        "--gpu-memory", "40", "--peak-tflops", "1", "--strategy", "ddp", "--batch-size", "16", "--json"]


def test_plan_calibrate_uses_the_fitted_efficiency(tmp_path: Path) -> None:
    run_dir = a_run(tmp_path, 0.05, world_size=1)
    code, out, err = run_main([*PLAN, "--calibrate", str(run_dir)])
    assert code == 0, err
    plan = json.loads(out)
    run = MeasuredRun(run_dir, {"world_size": 1, "step_seconds": 0.05}, load_config(run_dir / "config.yaml"))
    hardware = Hardware("GPU", 0, 1e12, "given", {}, {})
    expected = calibrate(run, measure_model(run.cfg, SPEC), hardware, 4).efficiency
    assert plan["calibration"]["efficiency"] == pytest.approx(expected) == plan["workload"]["efficiency"]
    ddp = next(row for row in plan["rows"] if row["strategy"] == "ddp")
    assert ddp["step"]["compute_s"] == pytest.approx(0.05)  # same batch, no communication priced: the run's step


@pytest.mark.parametrize(("extra", "said"), [
    (["--efficiency", "0.3"], "give one of them"),
    (["--model", "vit_tiny", "--set", "model.patch_size=4"], "is a run of 'cnn'"),
])
def test_calibrate_bad_input_exits_2(tmp_path: Path, extra: list[str], said: str) -> None:
    code, _, err = run_main([*PLAN, "--calibrate", str(a_run(tmp_path, 0.05, world_size=1)), *extra])
    assert code == 2 and said in err and "hint:" in err, err


def test_calibrate_needs_a_finished_run(tmp_path: Path) -> None:
    code, _, err = run_main([*PLAN, "--calibrate", str(tmp_path / "nowhere")])
    assert code == 2 and "no readable summary.json" in err, err
    (tmp_path / "summary.json").write_text(json.dumps({"step_seconds": 0.1}))
    code, _, err = run_main([*PLAN, "--calibrate", str(tmp_path / "summary.json")])
    assert code == 2 and "no config.yaml" in err, err


LAUNCH = ["launch", "--cluster", "derecho", "--account", "P0", "--nodes", "2", "--dry-run", "--plan"]
TRAIN = ["--", "nodescale", "train", "--model", "cnn", "--max-steps", "200000", "--batch-size", "16"]


def test_launch_plan_prints_the_plan_then_the_job_and_warns_of_a_short_time(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match=r"--time 00:05:00 is shorter than the \S+ the plan asks for ddp"):
        code, out, err = run_main([*LAUNCH, "--time", "00:05:00", *TRAIN])
    assert code == 0, err
    assert "cnn on 2 nodes x 4 NVIDIA A100-SXM4-40GB (8 ranks)" in out and "ddp +ac" in out
    assert out.index("recommended (*)") < out.index("#PBS")  # the plan, then the job script
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out, err = run_main([*LAUNCH, "--time", "12:00:00", *TRAIN])  # long enough: no such warning
    assert code == 0 and "recommended (*)" in out
    assert caught and not [w for w in caught if "shorter than" in str(w.message)]  # caught: pbsnodes' warning


@pytest.mark.parametrize(("argv", "said"), [
    ([*LAUNCH, "--", "python", "train.py"], "plans a `nodescale train` command only"),
    (["launch", "--cluster", "mahti", "--account", "P0", "--dry-run", "--plan", *TRAIN], "run `nodescale plan`"),
])
def test_launch_plan_bad_input_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                       said: str) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(argv)
    assert code == 2 and said in err and "hint:" in err, err


def test_a_gpu_runs_plan_is_priced_at_its_devices_peak(tmp_path: Path) -> None:
    from nodescale.plan.calibrate import estimate_run
    from nodescale.report.plan_section import plan_rows

    run_dir = a_run(tmp_path, 0.002, world_size=1)
    summary = {"world_size": 1, "step_seconds": 0.002, "device": "NVIDIA H100 80GB HBM3", "samples_per_second": 8000,
               "peak_memory_bytes": 10**9, "peak_memory_kind": "cuda_max_allocated"}
    estimate = estimate_run(MeasuredRun(run_dir, summary, load_config(run_dir / "config.yaml")), 0.4)
    facts = measure_model(load_config(run_dir / "config.yaml"), SPEC)
    # fp32 on a GPU with TF32: against the TF32 peak, as the run's MFU is (bench/peaks.yaml: 494.5 TFLOP/s).
    assert estimate.step is not None and estimate.step.comm_s == 0
    assert estimate.step.compute_s == pytest.approx(3 * facts.forward_flops_per_sample * 16 / (494.5e12 * 0.4))
    assert estimate.state.parameter_bytes == 4 * facts.parameter_count
    rows = {row[0]: row[1:] for row in plan_rows(estimate, summary)}
    assert rows["step time (ms)"][1] == "2.00" and rows["state + activations + gathered (MB)"][1].endswith("CUDA peak)")
    assert rows["throughput, all ranks (samples/s)"][2] == f"{16 / estimate.step.total_s / 8000:.2f}"
