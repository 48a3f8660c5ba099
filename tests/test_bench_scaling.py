"""``nodescale bench scaling``: the arithmetic by hand, the peak table, the plot, and one real run (1 and 2 ranks)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from conftest import read_summary, run_cli
from nodescale.bench import peaks, scaling_math
from nodescale.bench.scaling import ScalingPlan, check_train_args
from nodescale.bench.scaling_math import Measurement, scaling_rows
from nodescale.bench.scaling_results import collect, display_table
from nodescale.cli.run_flags import FLAG_NAMES
from nodescale.errors import UserError
from nodescale.figures import EFFICIENCY_LABEL, PROCESSES_LABEL, THROUGHPUT_LABEL, scaling_figure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- arithmetic


def test_strong_scaling_by_hand() -> None:
    # Global batch 64. Step times 64 ms, 40 ms, 26.67 ms -> 1000, 1600, 2400 samples/s.
    rows = scaling_rows([Measurement(4, 2400.0, 64 / 2400), Measurement(1, 1000.0, 0.064),
                         Measurement(2, 1600.0, 0.040)])
    assert [row.world_size for row in rows] == [1, 2, 4]  # sorted, base = smallest
    assert [row.speedup for row in rows] == pytest.approx([1.0, 1.6, 2.4])
    assert [row.ideal_speedup for row in rows] == [1.0, 2.0, 4.0]
    assert [row.efficiency for row in rows] == pytest.approx([1.0, 0.8, 0.6])
    # Fixed global batch: the throughput ratio is the step-time ratio (Amdahl's speedup).
    assert rows[1].speedup == pytest.approx(rows[0].step_seconds / rows[1].step_seconds)


def test_weak_scaling_by_hand_with_a_base_above_one() -> None:
    # 32 samples per process. 2 ranks: 0.100 s/step -> 640/s; 4 ranks: 0.125 s -> 1024/s; 8 ranks: 0.160 s -> 1600/s.
    rows = scaling_rows([Measurement(2, 640.0, 0.100), Measurement(4, 1024.0, 0.125), Measurement(8, 1600.0, 0.160)])
    assert [row.speedup for row in rows] == pytest.approx([1.0, 1.6, 2.5])
    assert [row.ideal_speedup for row in rows] == [1.0, 2.0, 4.0]  # N / base, base = 2
    assert [row.efficiency for row in rows] == pytest.approx([1.0, 0.8, 0.625])
    # Fixed per-process batch: efficiency is the classic weak efficiency step(base) / step(N).
    assert [row.efficiency for row in rows] == pytest.approx([0.100 / t for t in (0.100, 0.125, 0.160)])


def test_unknown_throughput_gives_unknown_speedup() -> None:
    rows = scaling_rows([Measurement(1, None, None), Measurement(2, 100.0, 0.1)])
    assert rows[0].speedup is None and rows[1].speedup is None and rows[1].efficiency is None
    assert scaling_rows([]) == []


def test_batch_split() -> None:
    assert scaling_math.per_process_batch(64, 1, "strong") == 64
    assert scaling_math.per_process_batch(64, 4, "strong") == 16
    assert scaling_math.per_process_batch(64, 4, "weak") == 64
    with pytest.raises(UserError, match="divide evenly") as caught:
        scaling_math.check_batch_divides(64, [1, 2, 3])
    assert "e.g. 66" in str(caught.value)  # the smallest multiple of 1, 2 and 3 from 64 up
    assert scaling_math.divisible_batch(4, [8]) == 8


def test_world_size_list() -> None:
    assert scaling_math.parse_world_sizes("4, 1,2") == [1, 2, 4]
    for bad in ("", "0,1", "1,x", "2,2", "-1"):
        with pytest.raises(UserError):
            scaling_math.parse_world_sizes(bad)


def test_mode_from_batches() -> None:
    assert scaling_math.infer_mode([(64, 64), (32, 64)]) == "strong"
    assert scaling_math.infer_mode([(32, 32), (32, 64)]) == "weak"
    assert scaling_math.infer_mode([(32, 32), (24, 48)]) is None
    assert scaling_math.fits_mode("weak", [(32, 32), (32, 64)])
    assert not scaling_math.fits_mode("strong", [(32, 32), (32, 64)])


def test_mfu_by_hand_and_unknown_is_none() -> None:
    # 1000 samples/s x 3 GFLOP per training sample = 3 TFLOP/s, on 2 devices of 100 TFLOP/s: 1.5%.
    assert scaling_math.achieved_flops(1000.0, 3e9) == pytest.approx(3e12)
    assert scaling_math.mfu(1000.0, 3e9, 100e12, 2) == pytest.approx(0.015)
    assert scaling_math.mfu(1000.0, 3e9, None, 2) is None  # unknown device
    assert scaling_math.mfu(1000.0, None, 100e12, 2) is None  # FLOPs not counted
    assert scaling_math.mfu(None, 3e9, 100e12, 2) is None


# ---------------------------------------------------------------- peak table


def test_peak_table_loads_and_every_entry_has_a_source() -> None:
    table = peaks.load_peaks()
    for name in ("NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "AMD Instinct MI250X"):
        assert name in table
    for entry in set(table.values()):
        assert entry.source.strip()
        assert entry.tflops and set(entry.tflops) <= set(peaks.DTYPES)
        assert all(value > 0 for value in entry.tflops.values())
    assert table["NVIDIA A100-SXM4-40GB"].flops("bf16") == pytest.approx(312e12)
    assert table["NVIDIA H100 80GB HBM3"].flops("bf16") == pytest.approx(989.5e12)  # dense, not the sparse 1979
    assert table["AMD Instinct MI250X"].flops("bf16") == pytest.approx(191.5e12)  # per GCD


def test_peak_file_lists_a_source_comment_per_entry() -> None:
    text = (Path(peaks.__file__).parent / "peaks.yaml").read_text()
    assert text.count("  - names:") == text.count("# Source:") == len(set(peaks.load_peaks().values()))


def test_unknown_devices_have_no_peak() -> None:
    assert peaks.find_peak("cpu (x86_64)") is None
    assert peaks.find_peak("NVIDIA A100") is None  # close is not equal: never guessed
    assert peaks.find_peak(None) is None
    v100 = peaks.find_peak("Tesla V100-SXM2-32GB")
    assert v100 is not None and v100.flops("bf16") is None  # no bf16 hardware: MFU unknown


def test_peak_dtype_choice() -> None:
    a100 = peaks.find_peak("NVIDIA A100-SXM4-40GB")
    mi250x = peaks.find_peak("AMD Instinct MI250X")
    assert peaks.peak_dtype("fp32", a100) == "tf32"  # cuDNN convolutions may use TF32
    assert peaks.peak_dtype("fp32", mi250x) == "fp32"  # no TF32 there
    assert peaks.peak_dtype("bf16", a100) == "bf16"
    assert peaks.peak_dtype("fp32", a100, "fp32") == "fp32"
    assert peaks.peak_dtype("fp32", None) == "fp32"


def test_malformed_peak_tables_are_refused() -> None:
    with pytest.raises(ValueError, match="no `source`"):
        peaks.parse_peaks("devices:\n  - names: [X]\n    tflops: {fp32: 1}\n")
    with pytest.raises(ValueError, match="twice"):
        peaks.parse_peaks("devices:\n  - {names: [X], source: s, tflops: {fp32: 1}}\n"
                          "  - {names: [X], source: s, tflops: {fp32: 2}}\n")
    with pytest.raises(ValueError, match="bad peak"):
        peaks.parse_peaks("devices:\n  - {names: [X], source: s, tflops: {fp64: 1}}\n")


# ---------------------------------------------------------------- plan, flags, plot


def test_plan_commands() -> None:
    plan = ScalingPlan(Path("out"), (1, 2), "strong", 64, 20, 5, ("--model", "cnn"))
    argv = plan.train_argv(2)
    assert argv[:3] == ["train", "--model", "cnn"]
    assert argv[argv.index("--nproc") + 1] == "2" and argv[argv.index("--batch-size") + 1] == "32"
    assert "train.timing_warmup_steps=5" in argv and argv[-1] == str(Path("out/ws-2"))
    weak = ScalingPlan(Path("out"), (1, 2), "weak", 64, 20, 5)
    assert weak.train_argv(2)[weak.train_argv(2).index("--batch-size") + 1] == "64"


def test_train_flags_the_benchmark_controls_are_refused() -> None:
    check_train_args(["--precision", "bf16", "--set", "optim.lr=0.1"], FLAG_NAMES)
    for args in (["--nproc", "4"], ["--batch-size=8"], ["--set", "train.max_steps=3"], ["--set=out=x"]):
        with pytest.raises(UserError, match="set by nodescale bench scaling"):
            check_train_args(args, FLAG_NAMES)


def _result(rows: list[dict]) -> dict:
    return {"mode": "strong", "settings": {"model": "cnn", "dataset": "digits", "strategy": "ddp"},
            "device": "cpu (x86_64)", "rows": rows}


def test_plot_axes_are_labelled_with_units() -> None:
    rows = [{"world_size": 1, "samples_per_second": 1000.0, "efficiency": 1.0},
            {"world_size": 2, "samples_per_second": 1600.0, "efficiency": 0.8},
            {"world_size": 4, "samples_per_second": None, "efficiency": None}]
    fig = scaling_figure(_result(rows))
    throughput, efficiency = fig.axes
    assert throughput.get_xlabel() == efficiency.get_xlabel() == PROCESSES_LABEL == "processes (world size)"
    assert throughput.get_ylabel() == THROUGHPUT_LABEL == "throughput (samples/s)"
    assert efficiency.get_ylabel() == EFFICIENCY_LABEL == "efficiency (%)"
    lines = {line.get_label(): line for line in throughput.get_lines()}
    # The ideal line continues the base linearly over every world size; the measured one skips the unknown.
    assert list(lines["ideal (linear)"].get_ydata()) == pytest.approx([1000.0, 2000.0, 4000.0])
    assert list(lines["measured"].get_xdata()) == [1, 2]
    eff = {line.get_label(): line for line in efficiency.get_lines()}
    assert list(eff["measured"].get_ydata()) == pytest.approx([100.0, 80.0])
    assert [t.get_text() for t in throughput.get_xticklabels()] == ["1", "2", "4"]
    study = scaling_figure(_result([{**row, "nodes": n} for row, n in zip(rows, (1, 2, 4), strict=True)]))
    assert [t.get_text() for t in study.axes[1].get_xticklabels()] == ["1\n1 node", "2\n2 nodes", "4\n4 nodes"]


def test_display_table_marks_unknown_mfu_and_oversubscription_and_shows_tokens_for_language_models() -> None:
    row = {"world_size": 4, "batch_size_per_process": 16, "global_batch_size": 64, "samples_per_second": 1234.56,
           "speedup": 1.5, "ideal_speedup": 4.0, "efficiency": 0.375, "step_ms": 51.84, "achieved_tflops": None,
           "mfu": None, "oversubscribed": True}
    headers, rows = display_table(_result([row]))
    assert "tokens/s" not in headers  # a classifier's table has no column of n/a
    assert rows == [["4 *", "16", "64", "1,234.6", "1.50", "4.00", "37.5", "51.84", "unknown", "unknown"]]
    headers, rows = display_table(_result([{**row, "tokens_per_second": 1234.56 * 64}]))
    assert dict(zip(headers, rows[0], strict=True))["tokens/s"] == "79,012"


# ---------------------------------------------------------------- CLI


def test_mistakes_are_reported_before_any_run(tmp_path: Path) -> None:
    result = run_cli(["bench", "scaling", "--out", str(tmp_path / "s"), "--world-sizes", "1,3"], tmp_path, check=False)
    assert result.returncode == 2 and "divide evenly" in result.stderr and "Traceback" not in result.stderr
    result = run_cli(["bench", "scaling", "--out", str(tmp_path / "s"), "--world-sizes", "1,2", "--", "--nproc", "4"],
                     tmp_path, check=False)
    assert result.returncode == 2 and "set by nodescale bench scaling" in result.stderr
    assert not (tmp_path / "s").exists()
    dry = run_cli(["bench", "scaling", "--out", "s", "--world-sizes", "1,2", "--mode", "weak", "--dry-run", "--",
                   "--precision", "bf16"], tmp_path)
    lines = dry.stdout.splitlines()
    assert len(lines) == 2 and lines[1].startswith("nodescale train --precision bf16 --nproc 2 --batch-size 64 ")
    assert not (tmp_path / "s").exists()  # a dry run writes nothing
    (tmp_path / "empty").mkdir()
    result = run_cli(["bench", "scaling", "--collect", "--out", str(tmp_path / "empty")], tmp_path, check=False)
    assert result.returncode == 2 and "holds no finished runs" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.multiproc
def test_real_scaling_run(tmp_path: Path) -> None:
    out = tmp_path / "scaling"
    result = run_cli(["bench", "scaling", "--world-sizes", "1,2", "--max-steps", "8", "--warmup-steps", "3",
                      "--batch-size", "32", "--out", str(out)], tmp_path)
    assert "samples/s" in result.stdout and "MFU" in result.stdout
    data = json.loads((out / "scaling.json").read_text())
    assert data["mode"] == "strong" and data["base_world_size"] == 1
    rows = {row["world_size"]: row for row in data["rows"]}
    assert set(rows) == {1, 2}
    # Strong scaling: the global batch stays 32, split in two at world size 2.
    assert [(rows[n]["batch_size_per_process"], rows[n]["global_batch_size"]) for n in (1, 2)] == [(32, 32), (16, 32)]
    assert rows[1]["speedup"] == 1.0 and rows[1]["efficiency"] == 1.0
    one, two = read_summary(out / "ws-1"), read_summary(out / "ws-2")
    assert one["timed_steps"] == two["timed_steps"] == 5  # 8 steps, 3 warm-up
    assert rows[2]["samples_per_second"] == two["samples_per_second"]
    assert rows[2]["speedup"] == pytest.approx(two["samples_per_second"] / one["samples_per_second"])
    assert rows[2]["efficiency"] == pytest.approx(rows[2]["speedup"] / 2)
    assert rows[2]["step_ms"] == pytest.approx(two["step_seconds"] * 1000)
    # A CPU has no peak: MFU unknown and said so, FLOPs still counted.
    assert data["peak"] is None and rows[1]["mfu"] is None and any("MFU unknown" in n for n in data["notes"])
    assert data["training_flops_per_sample"] > 0 and rows[1]["achieved_tflops"] > 0
    assert (out / "scaling.png").read_bytes()[:8] == PNG_SIGNATURE
    with open(out / "scaling.csv", newline="") as handle:
        assert [int(r["world_size"]) for r in csv.DictReader(handle)] == [1, 2]
    fig = scaling_figure(data)
    assert [ax.get_ylabel() for ax in fig.axes] == ["throughput (samples/s)", "efficiency (%)"]

    # The same directory again: refused; --collect analyses the runs already there (no training).
    again = run_cli(["bench", "scaling", "--world-sizes", "1,2", "--out", str(out)], tmp_path, check=False)
    assert again.returncode == 2 and "already holds runs" in again.stderr
    collected = collect(out)  # in-process: another CLI start costs this 2-core machine ~10 s
    assert collected["mode"] == "strong"  # inferred: the same global batch
    assert [r["speedup"] for r in collected["rows"]] == [r["speedup"] for r in data["rows"]]
    assert collected["rows"][0]["oversubscribed"] is None  # runs read back: the machine is not known


def _fake_run(run_dir: Path, world_size: int, per_process: int, samples_per_second: float, device: str) -> None:
    """A run directory as `nodescale train` leaves it, as far as `collect` reads it (no training)."""
    from nodescale.config.load import dump_yaml
    from nodescale.config.schema import RunConfig

    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_yaml(RunConfig()))  # cnn on digits
    (run_dir / "summary.json").write_text(json.dumps({
        "world_size": world_size, "devices": world_size, "strategy": "ddp", "model": "cnn", "dataset": "digits",
        "precision": "fp32", "batch_size_per_process": per_process, "global_batch_size": per_process * world_size,
        "samples_per_second": samples_per_second, "samples_per_second_per_device": samples_per_second / world_size,
        "step_seconds": per_process * world_size / samples_per_second, "timed_steps": 40, "global_steps": 50,
        "timing_warmup_steps": 10, "timing_includes_warmup": False, "device": device,
    }))


def test_collect_with_a_known_peak_gives_mfu(tmp_path: Path) -> None:
    # Weak scaling on two A100s (made-up throughputs): the peak table gives MFU, fp32 against TF32.
    for n, rate in ((1, 20000.0), (2, 36000.0)):
        _fake_run(tmp_path / f"ws-{n}", n, 64, rate, "NVIDIA A100-SXM4-40GB")
    result = collect(tmp_path)
    assert result["mode"] == "weak"  # inferred: the same batch per process
    assert result["peak"]["dtype"] == "tf32" and result["peak"]["tflops"] == 156.0 and result["peak"]["source"]
    flops = result["training_flops_per_sample"]
    assert flops > 0
    two = result["rows"][1]
    assert two["speedup"] == pytest.approx(1.8) and two["efficiency"] == pytest.approx(0.9)
    assert two["mfu"] == pytest.approx(36000.0 * flops / (156e12 * 2))
    assert collect(tmp_path, peak_choice="fp32")["rows"][1]["mfu"] == pytest.approx(36000.0 * flops / (19.5e12 * 2))
    with pytest.raises(UserError, match="strong scaling keeps the global batch"):
        collect(tmp_path, mode="strong")
