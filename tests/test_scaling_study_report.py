"""The study report's MFU and GPU-energy-per-sample columns, from hand-built run directories (no training).

A 1- and 2-node study of the toy model (a linear regression, 20 features -> 1 target: 2 x 20 forward FLOPs,
so 3 x 40 = 120 training FLOPs per sample) on H100s in bf16 (989.5 TFLOP/s dense per device), 4 GPUs per
node. Throughputs are picked so the MFU is round: MFU = 120 x samples/s / (989.5e12 x devices).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from nodescale.bench import scaling_study
from nodescale.config.load import dump_yaml
from nodescale.observe.monitor import HOST_COLUMNS, device_columns
from nodescale.report.scaling_section import energy_per_sample, scaling_section
from nodescale.report.sources import ScalingSource

PEAK = 989.5e12  # bf16, NVIDIA H100 80GB HBM3 (bench/peaks.yaml)
FLOPS = 120  # training FLOPs per sample of toy on regression
GPUS, STEPS, GLOBAL_BATCH = 4, 10, 64
# nodes -> (samples/s, MFU it gives, the last cumulative energy_j of each GPU of each node)
SIZES = {
    1: (0.30 * PEAK * 4 / FLOPS, 0.30, [[1000, 1100, 1200, 1300]]),
    2: (0.24 * PEAK * 8 / FLOPS, 0.24, [[500, 500, 500, 500], [600, 600, 600, 600]]),
}
ENERGY = {1: 4600 / (STEPS * GLOBAL_BATCH), 2: 4400 / (STEPS * GLOBAL_BATCH)}  # J over steps x global batch


def write_monitor(path: Path, node: int, finals: list[float]) -> None:
    """A node's monitor file: two samples, each GPU's energy counter rising from 0 to its final value."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = [*HOST_COLUMNS, *device_columns(len(finals))]
    lines = [",".join(header)]
    for time, share in ((100.0, 0.0), (160.0, 1.0)):
        cells = {"time": time, "elapsed_s": time - 100, "host": f"gpu{node}", "node_rank": node}
        for index, final in enumerate(finals):
            cells |= {f"gpu{index}_util_percent": 90, f"gpu{index}_energy_j": final * share}
        lines.append(",".join(str(cells.get(name, "")) for name in header))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from nodescale.cli.run_flags import add_run_flags, resolve_config

    directory = tmp_path_factory.mktemp("study") / "study"
    parser = argparse.ArgumentParser(add_help=False)
    add_run_flags(parser)
    config = dump_yaml(resolve_config(parser.parse_args(["--model", "toy", "--dataset", "regression",
                                                         "--precision", "bf16"])))
    record = scaling_study.Study(directory, "slurm", "strong", GLOBAL_BATCH, STEPS, 2, GPUS, True, [], [])
    for nodes, (throughput, _, energies) in SIZES.items():
        run_dir = scaling_study.run_dir(directory, nodes)
        world = nodes * GPUS
        record.jobs.append(scaling_study.StudyJob(nodes, world, str(run_dir)))  # never submitted: no queue asked
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text(config)
        (run_dir / "summary.json").write_text(json.dumps({
            "world_size": world, "devices": world, "device": "NVIDIA H100 80GB HBM3", "precision": "bf16",
            "model": "toy", "dataset": "regression", "strategy": "ddp", "global_steps": STEPS,
            "timing_warmup_steps": 2, "timed_steps": STEPS - 2, "batch_size_per_process": GLOBAL_BATCH // world,
            "global_batch_size": GLOBAL_BATCH, "samples_per_second": throughput,
            "step_seconds": GLOBAL_BATCH / throughput}))
        for node, finals in enumerate(energies):
            write_monitor(run_dir / "monitor" / f"node-{node}.csv", node, finals)
    scaling_study.write(record)
    result = scaling_study.collect_study(directory)
    text = scaling_section(ScalingSource(directory, result, "study"), directory.parent / "report", "study")
    lines = [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
             if line.startswith("| ")]
    table = [dict(zip(lines[0], row, strict=True)) for row in lines[1:]]
    return {"dir": directory, "result": result, "text": text, "table": table}


def test_mfu_follows_from_flops_throughput_and_peak(study: dict[str, Any]) -> None:
    result = study["result"]
    assert result["training_flops_per_sample"] == FLOPS
    assert result["peak"]["tflops"] == PEAK / 1e12 and result["peak"]["dtype"] == "bf16"
    assert [row["mfu"] for row in result["rows"]] == pytest.approx([SIZES[1][1], SIZES[2][1]])
    assert [row["achieved_tflops"] for row in result["rows"]] == pytest.approx(
        [FLOPS * SIZES[n][0] / 1e12 for n in (1, 2)])
    assert [(row["nodes"], row["processes"], row["MFU (%)"]) for row in study["table"]] == [
        ("1", "4", "30.00"), ("2", "8", "24.00")], study["text"]
    assert "MFU against 989.5 TFLOP/s (bf16) per device" in study["text"]


def test_energy_per_sample_is_all_gpus_joules_over_steps_times_global_batch(study: dict[str, Any]) -> None:
    for nodes in (1, 2):
        assert energy_per_sample(scaling_study.run_dir(study["dir"], nodes)) == pytest.approx(ENERGY[nodes])
    assert [row["GPU energy / sample (J)"] for row in study["table"]] == ["7.1875", "6.8750"], study["text"]


def test_energy_per_sample_unknown_when_a_gpu_or_the_monitor_has_none(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"global_steps": STEPS, "global_batch_size": GLOBAL_BATCH}))
    assert energy_per_sample(run_dir) is None  # no --monitor
    write_monitor(run_dir / "monitor" / "node-0.csv", 0, [100, 200])
    assert energy_per_sample(run_dir) == pytest.approx(300 / (STEPS * GLOBAL_BATCH))
    write_monitor(run_dir / "monitor" / "node-1.csv", 1, [])  # a node whose GPUs report no energy
    assert energy_per_sample(run_dir) is None  # a sum over some nodes would read as the run's
