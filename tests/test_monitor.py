"""``--monitor``: a real sampler on this machine, the device readers, and the report's monitor section.

The sampler runs for real (psutil on this process and on busy and exiting
children); NVML is looked for for real (on a machine without a driver it must
quietly find nothing); the rocm-smi parsers read the outputs in
``tests/golden/rocm_smi`` (see its README for where they come from).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nodescale.observe.device_parsing import (
    DeviceSample,
    cuda_visible_indices,
    rocm_smi_cards,
    rocm_smi_name,
    rocm_smi_sample,
    rocm_visible_indices,
)
from nodescale.observe.device_readers import NvmlReader, detect_reader
from nodescale.observe.monitor import HOST_COLUMNS, NodeMonitor, device_columns
from nodescale.report.build import build_report

ROCM_GOLDEN = Path(__file__).resolve().parent / "golden" / "rocm_smi"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
INTERVAL = 0.2


def _rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


def _has_gpu_driver() -> bool:
    return (shutil.which("nvidia-smi") is not None or shutil.which("rocm-smi") is not None
            or Path("/dev/nvidiactl").exists())


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


def test_monitor_samples_this_process_and_a_busy_child(tmp_path: Path) -> None:
    """Rows on the interval with plausible figures; a pid that exits mid-run (and one already gone) is dropped."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    short = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.4)"])
    path = tmp_path / "monitor" / "node-3.csv"
    monitor = NodeMonitor(path, INTERVAL, [os.getpid(), busy.pid, short.pid, _dead_pid()], "testhost", 3)
    try:
        monitor.start()
        time.sleep(0.8)
        short.wait()  # reaped while the monitor runs: its pid is gone for good
        time.sleep(0.7)
        result = monitor.stop()
    finally:
        busy.kill()
        busy.wait()

    header, rows = _rows(path)
    assert path.read_text().endswith("\n")  # the file is complete: the last row was written whole
    on_cpu = not _has_gpu_driver()
    assert header[:len(HOST_COLUMNS)] == list(HOST_COLUMNS)
    if on_cpu:
        assert header == list(HOST_COLUMNS) and result.devices == [] and result.energy_joules is None
    assert result.path == path and result.interval_s == INTERVAL and result.samples == len(rows)
    # ~1.5 s at 0.2 s: the first row, ~7 on the interval and the final one (loose: 2 shared cores).
    assert 6 <= len(rows) <= 11, len(rows)
    assert all(len(row) == len(header) and None not in row.values() for row in rows)
    assert {row["host"] for row in rows} == {"testhost"} and {row["node_rank"] for row in rows} == {"3"}

    times = [float(row["time"]) for row in rows]
    elapsed = [float(row["elapsed_s"]) for row in rows]
    assert elapsed[0] == 0.0 and all(b > a for a, b in zip(times, times[1:], strict=False))
    regular = elapsed[:-1]  # the last row is stop()'s, off the grid
    steps = [b - a for a, b in zip(regular, regular[1:], strict=False)]
    assert statistics.median(steps) == pytest.approx(INTERVAL, abs=0.05)
    # Deadlines are start + k * interval: each row sits near a multiple of the interval (no drift).
    offsets = [abs(e / INTERVAL - round(e / INTERVAL)) * INTERVAL for e in regular]
    assert statistics.median(offsets) < 0.03 and max(offsets) < 0.09, regular

    cores = psutil.cpu_count() or 1
    total_memory = psutil.virtual_memory().total
    assert rows[0]["cpu_percent"] == "" and rows[0]["procs_cpu_percent"] == ""  # no interval behind the first
    for row in rows[1:]:
        assert 0.0 <= float(row["cpu_percent"]) <= 100.0
        assert 0.0 <= float(row["procs_cpu_percent"]) <= 100.0 * cores + 5
    for row in rows:
        assert 10e6 < int(row["procs_rss_bytes"]) < total_memory
        assert 0 < int(row["host_mem_used_bytes"]) <= int(row["host_mem_total_bytes"]) == total_memory
    # The busy child spins a whole core; even sharing two loaded cores with other work it shows.
    assert max(float(row["procs_cpu_percent"]) for row in rows[1:]) > 10.0
    # Sampling went on after the short child exited (its last rows are later than ~0.8 s).
    assert elapsed[-1] > 1.2


def test_stop_is_prompt_idempotent_and_final(tmp_path: Path) -> None:
    """A 30 s interval: stop() returns at once with the first row and a final one; a second stop() changes nothing."""
    path = tmp_path / "node-0.csv"
    monitor = NodeMonitor(path, 30.0, [os.getpid()], "h", 0)
    monitor.start()
    time.sleep(0.3)
    began = time.monotonic()
    result = monitor.stop()
    assert time.monotonic() - began < 1.0
    _, rows = _rows(path)
    assert result.samples == len(rows) == 2
    assert float(rows[1]["elapsed_s"]) == pytest.approx(0.3, abs=0.2)
    assert monitor.stop() is result
    monitor.start()  # after stop: nothing restarts, nothing is rewritten
    assert _rows(path)[1] == rows


def test_stop_without_start_and_an_unwritable_path(tmp_path: Path) -> None:
    """Neither raises: a monitor that never ran records nothing, one that cannot write warns and records nothing."""
    never = NodeMonitor(tmp_path / "never.csv", 1.0, [], "h", 0).stop()
    assert never.samples == 0 and not (tmp_path / "never.csv").exists()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monitor = NodeMonitor(blocker / "node-0.csv", 0.1, [os.getpid()], "h", 0)
    with pytest.warns(RuntimeWarning, match="cannot write"):
        monitor.start()
        time.sleep(0.2)
        assert monitor.stop().samples == 0


def test_device_readers_find_nothing_without_a_driver() -> None:
    """NVML without a driver, and no rocm-smi on PATH: None, quietly. With a driver, a reader that reads."""
    reader = detect_reader()
    if not _has_gpu_driver():
        assert reader is None
        assert NvmlReader.open() is None
        return
    assert reader is not None  # pragma: no cover - on a GPU machine
    try:
        names = reader.names()
        samples = reader.sample()
        assert names and len(samples) == len(names)
        for sample in samples:
            assert sample.mem_total_bytes is None or sample.mem_total_bytes > 0
            assert sample.util_percent is None or 0 <= sample.util_percent <= 100
    finally:
        reader.close()


UUIDS = ["GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", "GPU-1d5d1d1e-3b4a-8c2f-0e9d-7c6b5a493827",
         "GPU-1d5e0000-aaaa-bbbb-cccc-dddddddddddd", "GPU-f00dcafe-0000-1111-2222-333344445555"]


@pytest.mark.parametrize(("value", "expected"), [
    (None, [0, 1, 2, 3]),
    ("", []),
    ("2,0", [2, 0]),
    ("0,-1,1", [0]),  # CUDA stops at the first invalid entry
    ("1,1,2", [1]),  # a repeat is invalid too
    ("0,9", [0]),
    ("GPU-f00dcafe-0000-1111-2222-333344445555,0", [3, 0]),
    ("gpu-1D5D1, GPU-8932", [1, 0]),  # unique prefixes, any case, spaces around
    ("GPU-1d5", []),  # ambiguous prefix: names no device
    ("1d5e0000", [2]),
    ("MIG-4b1e3c2d-0000-5555-aaaa-0123456789ab", [3]),
    ("MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1/0", [0]),
])
def test_cuda_visible_devices_map_to_nvml_indices(value: str | None, expected: list[int]) -> None:
    migs = {"MIG-4b1e3c2d-0000-5555-aaaa-0123456789ab": 3}
    assert cuda_visible_indices(value, UUIDS, migs) == expected


def test_rocm_visible_devices() -> None:
    names = rocm_smi_cards((ROCM_GOLDEN / "names_mi250x.json").read_text())
    uids = {card: fields["unique id"] for card, fields in names.items()}
    assert rocm_visible_indices([1, 0, 3, 2], uids, {}) == [0, 1, 2, 3]
    assert rocm_visible_indices([0, 1, 2, 3], uids, {"ROCR_VISIBLE_DEVICES": "2,3"}) == [2, 3]
    assert rocm_visible_indices([0, 1, 2, 3], uids, {"ROCR_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "1"}) == [3]
    assert rocm_visible_indices([0, 1], uids, {"ROCR_VISIBLE_DEVICES": "GPU-2c7e90a4f1b3d566"}) == [1]
    assert rocm_visible_indices([0, 1, 2], uids, {"CUDA_VISIBLE_DEVICES": "2,7,0"}) == [2]
    assert rocm_visible_indices([0, 1], uids, {"HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": "1"}) == []


@pytest.mark.parametrize(("name", "expected"), [
    ("rocm43_rx6800.json", {0: DeviceSample(87.0, 9021685760, 17163091968, 68.0, 203.0, None)}),
    ("rocm57_mi250x.json", {
        0: DeviceSample(98.0, 51539607552, 68702699520, 45.0, 391.0, 1086922267852.62e-6),
        1: DeviceSample(95.0, 51003785216, 68702699520, 41.0, None, 1054684433149.61e-6),  # secondary die
    }),
    ("rocm61_mi300x.json", {
        0: DeviceSample(100.0, 150257352704, 205822885888, 59.0, 612.0, 4389472761263.87e-6),  # junction: edge N/A
        1: DeviceSample(0.0, 297873408, 205822885888, 46.0, None, 4295026658.78e-6),
    }),
    ("rocm30_vega10.json", {0: DeviceSample(63.0, None, None, 77.0, 222.0, None)}),
])
def test_rocm_smi_parser_on_recorded_outputs(name: str, expected: dict[int, DeviceSample]) -> None:
    cards = rocm_smi_cards((ROCM_GOLDEN / name).read_text())
    parsed = {card: rocm_smi_sample(fields) for card, fields in cards.items()}
    assert parsed.keys() == expected.keys()
    for card, sample in parsed.items():
        want = expected[card]
        assert sample.energy_j == pytest.approx(want.energy_j)
        assert sample == DeviceSample(want.util_percent, want.mem_used_bytes, want.mem_total_bytes, want.temp_c,
                                      want.power_w, sample.energy_j)


def test_rocm_smi_names_and_bad_output() -> None:
    for name, product in (("names_mi250x.json", "AMD INSTINCT MI250X"), ("names_mi300x.json", "AMD Instinct MI300X")):
        cards = rocm_smi_cards((ROCM_GOLDEN / name).read_text())
        assert sorted(cards) == [0, 1] and {rocm_smi_name(fields) for fields in cards.values()} == {product}
    assert rocm_smi_name({}) == "AMD GPU"
    text = (ROCM_GOLDEN / "rocm43_rx6800.json").read_text()
    assert rocm_smi_cards("WARNING: a note first\n" + text + "\ntrailing text") == rocm_smi_cards(text)
    for bad in ("", "ERROR: No AMD GPUs specified", "{\"card0\": ", "[1, 2]", "{\"system\": {}}"):
        assert rocm_smi_cards(bad) == {}


# --- the report -------------------------------------------------------------------------------------------------


def _write_monitor_csv(path: Path, node: int, start: float, gpus: int, energy: bool, rows: int) -> None:
    """A monitor file in the exact format NodeMonitor writes, with known numbers (and a last line cut off)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow([*HOST_COLUMNS, *device_columns(gpus)])
        for k in range(rows):
            cpu = "" if k == 0 else f"{10.0 + 7 * k:.1f}"
            procs = "" if k == 0 else f"{90.0 + 11 * k + node:.1f}"
            row = [f"{start + k:.3f}", f"{float(k):.3f}", f"host{node}", node, cpu, procs,
                   1_000_000_000 + 50_000_000 * k, 30_000_000_000, 500_000_000_000]
            for gpu in range(gpus):
                row += [f"{40.0 + 5 * k + gpu:.1f}", 20_000_000_000 + 1_000_000_000 * k + gpu, 80_000_000_000,
                        f"{50.0 + k:.1f}", f"{300.0 + 10 * k + gpu:.2f}", f"{310.5 * k + gpu:.3f}" if energy else ""]
            writer.writerow(row)
    with open(path, "a") as handle:
        handle.write(f"{start + rows:.3f},{float(rows):.3f},host{node}")  # a crash mid-row


def _mean_max(values: list[float]) -> str:
    return f"{sum(values) / len(values):,.1f} / {max(values):,.1f}"


def _table_row(text: str, first: str) -> list[str]:
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells and cells[0] == first:
            return cells[1:]
    raise AssertionError(f"no table row {first!r}")


def test_report_shows_the_monitor_next_to_throughput(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    start = 1_700_000_000.0
    (run / "summary.json").write_text(json.dumps({"world_size": 4, "global_steps": 6, "samples_per_second": 900.0}))
    steps = [{"time": start + 2 * i + 1.5, "kind": "step", "step": 2 * i + 2, "epoch": 0, "loss": 2.0 / (i + 1),
              "samples_per_second": 800.0 + 50 * i} for i in range(3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in steps))
    _write_monitor_csv(run / "monitor" / "node-0.csv", 0, start, gpus=2, energy=True, rows=8)
    _write_monitor_csv(run / "monitor" / "node-1.csv", 1, start + 0.4, gpus=1, energy=False, rows=7)

    report = build_report([run], tmp_path / "report")
    text = report.read_text()
    assert "### Node monitor" in text
    image = re.search(r"!\[node usage of [^\]]*\]\(([^)]+)\)", text)
    assert image and (report.parent / image.group(1)).read_bytes()[:8] == PNG_SIGNATURE

    for node, gpus in ((0, 2), (1, 1)):
        _, rows = _rows(run / "monitor" / f"node-{node}.csv")
        rows = [row for row in rows if None not in row.values()]
        cells = _table_row(text, f"node {node}")
        cpu = [float(r["cpu_percent"]) for r in rows if r["cpu_percent"]]
        procs = [float(r["procs_cpu_percent"]) for r in rows if r["procs_cpu_percent"]]
        util = [float(r[f"gpu{g}_util_percent"]) for r in rows for g in range(gpus)]
        memory = [int(r[f"gpu{g}_mem_used_bytes"]) for r in rows for g in range(gpus)]
        assert cells[:7] == [f"host{node}", str(len(rows)), _mean_max(cpu), _mean_max(procs),
                             f"{max(int(r['procs_rss_bytes']) for r in rows) / 1e6:,.1f}", _mean_max(util),
                             f"{max(memory) / 1e6:,.1f}"]
        if node == 0:
            energy = sum(float(rows[-1][f"gpu{g}_energy_j"]) for g in range(gpus))
            assert cells[7] == f"{energy:,.1f}"
        else:
            assert cells[7] == "n/a"  # node 1's GPU has no energy counter
    assert "2 row(s) of the monitor files were incomplete" in text
    assert "Device energy over the sampled period, all nodes" not in text  # not every node reported it
