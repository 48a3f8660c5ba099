"""``nodescale report``: two real tiny runs, the scaling directory made from them, a bench comm file, bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import read_summary, run_cli
from nodescale.bench.scaling_results import collect, write_outputs
from nodescale.errors import UserError
from nodescale.figures import busbw_figure, curves_figure, throughput_figure
from nodescale.report.build import build_report
from nodescale.report.sources import CommSource, RunSource, load_source

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ROOT/scale/ws-1`` and ``ws-2``: 6 steps of cnn on digits, global batch 32, collected as a scaling dir.

    The runs are made the way a cluster user makes them (one ``nodescale
    train`` per world size, then collected), so that path is tested too.
    """
    root = tmp_path_factory.mktemp("report")
    common = ["train", "--max-steps", "6", "--log-every", "2", "--set", "train.timing_warmup_steps=2", "--no-progress"]
    run_cli([*common, "--nproc", "1", "--batch-size", "32", "--out", str(root / "scale" / "ws-1")], root)
    run_cli([*common, "--nproc", "2", "--batch-size", "16", "--out", str(root / "scale" / "ws-2")], root)
    # In-process, as `nodescale bench scaling --collect --out ROOT/scale` would: one CLI start less.
    write_outputs(root / "scale", collect(root / "scale"))
    return root


def _images(report: Path) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report.read_text())


def _row(text: str, label: str) -> list[str]:
    """The cells of the first table row whose first cell is ``label``."""
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells and cells[0] == label:
            return cells[1:]
    raise AssertionError(f"no table row {label!r}")


@pytest.mark.multiproc
def test_two_runs_and_a_scaling_dir_side_by_side(runs: Path) -> None:
    scale = runs / "scale"
    result = run_cli(["report", str(scale / "ws-1"), str(scale / "ws-2"), str(scale)], runs)
    made = sorted(runs.glob("report-*/report.md"))  # several DIRs: report-<time> in the current directory
    assert len(made) == 1 and str(made[0].relative_to(runs)) in result.stdout
    report = made[0]
    text = report.read_text()
    assert "## Comparison of 2 runs" in text
    one, two = read_summary(scale / "ws-1"), read_summary(scale / "ws-2")
    # The comparison table shows each run's own summary.json figures, side by side.
    assert _row(text, "processes (world size)")[:2] == ["1", "2"]
    assert _row(text, "throughput, all ranks (samples/s)")[:2] == [
        f"{one['samples_per_second']:,.1f}", f"{two['samples_per_second']:,.1f}"]
    assert _row(text, "average step time (ms)")[:2] == [
        f"{one['step_seconds'] * 1000:,.2f}", f"{two['step_seconds'] * 1000:,.2f}"]
    assert _row(text, "validation loss")[:2] == [f"{one['val_loss']:.4f}", f"{two['val_loss']:.4f}"]
    assert _row(text, "validation accuracy")[:2] == [f"{one['val_accuracy']:.2%}", f"{two['val_accuracy']:.2%}"]
    assert _row(text, "peak memory (MB)")[0].startswith(f"{one['peak_memory_bytes'] / 1e6:,.1f}")
    # The scaling section: its table, with the speedup of world size 2 from the two summaries.
    assert "## bench scaling `scale`" in text
    speedup = two["samples_per_second"] / one["samples_per_second"]
    assert _row(text, "2")[3] == f"{speedup:.2f}" and _row(text, "1")[3] == "1.00"
    # Every image the report shows exists and is a PNG.
    images = _images(report)
    assert {"report-compare-curves.png", "report-compare-throughput.png", "report-ws-1-curves.png",
            "report-ws-2-throughput.png", "report-scale-scaling.png"} <= set(images)
    for name in images:
        assert (report.parent / name).read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.multiproc
def test_plots_show_what_they_claim(runs: Path) -> None:
    one, two = (load_source(runs / "scale" / name) for name in ("ws-1", "ws-2"))
    assert isinstance(one, RunSource) and isinstance(two, RunSource)
    one.label, two.label = "ws-1", "ws-2"
    curves = curves_figure([one, two], "loss and accuracy")
    assert curves is not None
    loss, accuracy = curves.axes
    assert (loss.get_xlabel(), loss.get_ylabel()) == ("optimiser step", "loss")
    assert (accuracy.get_xlabel(), accuracy.get_ylabel()) == ("optimiser step", "accuracy (%)")
    training = {line.get_label(): line for line in loss.get_lines()}
    steps = [r["step"] for r in one.records("step")]
    assert list(training["ws-1 training"].get_xdata()) == steps == [2, 4, 6]
    assert list(training["ws-1 training"].get_ydata()) == pytest.approx([r["loss"] for r in one.records("step")])
    # The final evaluation (mid-epoch) is the validation point at the last step.
    assert list(training["ws-2 validation"].get_ydata()) == pytest.approx([two.summary["val_loss"]])
    throughput = throughput_figure([one], "throughput")
    assert throughput is not None
    ax = throughput.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("optimiser step", "throughput (samples/s)")
    dashed = [line for line in ax.get_lines() if "summary" in line.get_label()]
    assert list(dashed[0].get_ydata()) == pytest.approx([one.summary["samples_per_second"]] * 2)


@pytest.mark.multiproc
def test_one_run_reports_into_its_own_directory(runs: Path) -> None:
    run_dir = runs / "scale" / "ws-2"
    assert build_report([run_dir]) == run_dir / "report.md"  # in-process: the CLI is tested above
    text = (run_dir / "report.md").read_text()
    assert "## Run `ws-2`" in text and "Comparison" not in text
    # The plan beside it: the state bytes the plan gives its config equal the measured; no CPU peak, no step time.
    assert "### Plan against measured: `ws-2`" in text
    assert _row(text, "state per rank (MB)")[2] == "1.00" and _row(text, "step time (ms)")[0] == "n/a"
    assert all((run_dir / name).is_file() for name in _images(run_dir / "report.md"))


def test_bench_comm_directory(tmp_path: Path) -> None:
    # results.json as `nodescale bench comm` writes it: a list of rows.
    rows = [{"op": op, "bytes": size, "requested_bytes": size, "dtype": "float32", "in_place": in_place,
             "time_us": size / 1000, "algbw_GBps": size / 1e6, "busbw_GBps": size / 5e5 + in_place,
             "wrong": 0, "correct": True, "world_size": 2, "backend": "gloo", "device": "cpu"}
            for op in ("all_reduce", "all_gather") for size in (1024, 1 << 20) for in_place in (False, True)]
    comm = tmp_path / "comm"
    comm.mkdir()
    (comm / "results.json").write_text(json.dumps(rows))
    report = build_report([comm], tmp_path / "out")
    text = report.read_text()
    # Bus bandwidth at the largest size (1 MiB) for each op and variant, nothing of the small size.
    assert _row(text, "all_reduce")[6] == f"{(1 << 20) / 5e5:.2f}"
    assert "1,048,576 (1 MiB)" in text and "1,024 (1 KiB)" not in text
    assert _row(text, "backend") == ["gloo"]  # settings every row repeats, shown once
    source = load_source(comm)
    assert isinstance(source, CommSource)
    source.label = "comm"
    fig = busbw_figure(source.rows, "busbw")
    assert fig is not None
    labels = (fig.axes[0].get_xlabel(), fig.axes[0].get_ylabel())
    assert labels == ("message size (bytes)", "bus bandwidth (GB/s, 1e9 B/s)")
    assert len(fig.axes[0].get_lines()) == 4  # 2 ops x in place / out of place
    assert (tmp_path / "out" / "report-comm-busbw.png").read_bytes()[:8] == PNG_SIGNATURE


def test_a_directory_of_no_known_kind_is_refused(tmp_path: Path) -> None:
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    result = run_cli(["report", str(tmp_path / "junk")], tmp_path, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "not a run or benchmark directory" in result.stderr and "summary.json and metrics.jsonl" in result.stderr
    with pytest.raises(UserError, match="is not a directory"):
        build_report([tmp_path / "missing"])
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "summary.json").write_text("{}")
    with pytest.raises(UserError, match="did the run finish"):
        build_report([tmp_path / "half"])
    assert not list(tmp_path.glob("*/report.md"))  # nothing written for a refused input
