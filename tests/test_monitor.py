"""``--monitor``: a real sampler on this machine, and the device readers (the report's section: test_monitor_report.py).

The sampler runs for real (psutil on this process and on busy and exiting
children), the tests waiting for the rows they check, never for a time; its schedule is
checked to the millisecond on a scripted clock. NVML is looked for for real (on a machine
without a driver it must quietly find nothing); the rocm-smi parsers read the outputs in
``tests/golden/rocm_smi`` (see its README for where they come from).
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

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
from nodescale.observe.monitor import HOST_COLUMNS, NodeMonitor

ROCM_GOLDEN = Path(__file__).resolve().parent / "golden" / "rocm_smi"
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


def _rows_written(path: Path) -> int:
    """Whole rows in the monitor's file so far (it is written and flushed a row at a time)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    return max(text.count("\n") - 1, 0)


def _wait_for_rows(path: Path, count: int) -> int:
    """Until ``path`` holds ``count`` rows (the sampler's event, not a time); the rows then written."""
    deadline = time.monotonic() + 120  # only a test that is failing waits this long
    while (written := _rows_written(path)) < count:
        assert time.monotonic() < deadline, f"the monitor wrote {written} of {count} rows"
        time.sleep(0.02)
    return written


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system  # what psutil's cpu_percent counts


def test_monitor_samples_this_process_and_a_busy_child(tmp_path: Path) -> None:
    """Rows on the interval with plausible figures; a pid that exits mid-run (and one already gone) is dropped."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    short = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    path = tmp_path / "monitor" / "node-3.csv"
    monitor = NodeMonitor(path, INTERVAL, [os.getpid(), busy.pid, short.pid, _dead_pid()], "testhost", 3)
    spinner = psutil.Process(busy.pid)
    try:
        began = time.monotonic()
        monitor.start()
        _wait_for_rows(path, 1)  # the first row read the busy child's CPU time before this reading
        busy_from = _cpu_seconds(spinner)
        short.kill()
        short.wait()  # reaped while the monitor runs: its pid is gone for good
        rows_at_exit = _wait_for_rows(path, 2)
        _wait_for_rows(path, rows_at_exit + 3)  # sampling goes on after the exit
        deadline = time.monotonic() + 120
        while _cpu_seconds(spinner) < busy_from + 0.2:  # the child has spun (however many cores it shares)
            assert time.monotonic() < deadline, "the busy child got no CPU time"
            time.sleep(0.02)
        busy_to = _cpu_seconds(spinner)
        result = monitor.stop()  # whose final row reads the child's CPU time after busy_to
        ended = time.monotonic()
    finally:
        busy.kill()
        busy.wait()
        short.kill()
        short.wait()

    header, rows = _rows(path)
    assert path.read_text().endswith("\n")  # the file is complete: the last row was written whole
    on_cpu = not _has_gpu_driver()
    assert header[:len(HOST_COLUMNS)] == list(HOST_COLUMNS)
    if on_cpu:
        assert header == list(HOST_COLUMNS) and result.devices == [] and result.energy_joules is None
    assert result.path == path and result.interval_s == INTERVAL and result.samples == len(rows)
    assert len(rows) >= rows_at_exit + 3 + 1  # the rows waited for, and stop()'s
    assert all(len(row) == len(header) and None not in row.values() for row in rows)
    assert {row["host"] for row in rows} == {"testhost"} and {row["node_rank"] for row in rows} == {"3"}

    times = [float(row["time"]) for row in rows]
    elapsed = [round(float(row["elapsed_s"]) * 1000) for row in rows]  # whole milliseconds, as written
    assert elapsed[0] == 0 and times == sorted(times)  # (stop()'s row may come within the millisecond)
    # Deadlines are start + k * interval and a wait never ends before its deadline: each row has a tick of
    # its own (a late row skips ticks, none is added), however loaded the machine. The grid's exact timing:
    # test_rows_keep_to_the_grid_and_skip_the_ticks_a_late_sample_missed.
    ticks = [ms // round(INTERVAL * 1000) for ms in elapsed[:-1]]  # the last row is stop()'s, off the grid
    assert all(tick >= k for k, tick in enumerate(ticks)) and ticks == sorted(set(ticks)), elapsed
    assert elapsed[-1] >= elapsed[-2]

    cores = psutil.cpu_count() or 1
    total_memory = psutil.virtual_memory().total
    assert rows[0]["cpu_percent"] == "" and rows[0]["procs_cpu_percent"] == ""  # no interval behind the first
    for row in rows[1:]:
        assert 0.0 <= float(row["cpu_percent"]) <= 100.0
        assert 0.0 <= float(row["procs_cpu_percent"]) <= 100.0 * cores + 5
    for row in rows:
        assert 10e6 < int(row["procs_rss_bytes"]) < total_memory
        assert 0 < int(row["host_mem_used_bytes"]) <= int(row["host_mem_total_bytes"]) == total_memory
    # The child's own percentages, weighted by their intervals, add up to its CPU time between the first row
    # and the last, which spans at least busy_from..busy_to and lasts at most began..ended: one row at least
    # shows its mean rate over that span (less psutil's and the file's rounding to 0.1, twice 0.05).
    least = 100.0 * (busy_to - busy_from) / (ended - began) - 0.1
    assert max(float(row["procs_cpu_percent"]) for row in rows[1:]) >= least, (least, rows)


class _ScriptedClock:
    """The sampler's clock and stop event: a wait moves the clock to its deadline, late by the next of
    ``lateness`` (a busy machine, a slow sample); once they are used up it waits for stop()."""

    def __init__(self, lateness: list[float]) -> None:
        self.now = 0.0
        self.lateness = list(lateness)
        self.waiting = threading.Event()  # the script is done: the sampler waits for stop()
        self.stopped = threading.Event()

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_700_000_000.0 + self.now

    def wait(self, timeout: float) -> bool:
        if not self.lateness:
            self.waiting.set()
            return self.stopped.wait()
        self.now += max(timeout, 0.0) + self.lateness.pop(0)  # a deadline passed already: no wait
        return False

    def set(self) -> None:
        self.stopped.set()


def test_rows_keep_to_the_grid_and_skip_the_ticks_a_late_sample_missed(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Deadlines are start + k * interval: a late row does not move the later ones, and one later than a whole
    interval skips the ticks it missed rather than catching up."""
    from nodescale.observe import monitor as sampler

    clock = _ScriptedClock([0.0, 0.05, 0.0, 0.6, 0.01])  # the waits after rows 0-4
    monkeypatch.setattr(sampler, "time", SimpleNamespace(monotonic=clock.monotonic, time=clock.time,
                                                         thread_time=time.thread_time))
    path = tmp_path / "node-0.csv"
    monitor = NodeMonitor(path, 0.25, [os.getpid()], "h", 0)
    monitor._stop = clock  # type: ignore[assignment]  # its waits, on the scripted clock
    monitor.start()
    assert clock.waiting.wait(timeout=120)
    clock.now += 0.1  # stop() comes a little after the last row
    result = monitor.stop()
    _, rows = _rows(path)
    # 0.25 on time; 0.55 late by 0.05; 0.75 on the grid again (a drifting schedule: 0.80); 1.60 late by 0.6,
    # so ticks 1.25 and 1.50 are skipped and the next row is at 1.75 + 0.01; then stop()'s final row.
    assert [float(row["elapsed_s"]) for row in rows] == [0.0, 0.25, 0.55, 0.75, 1.6, 1.76, 1.86]
    assert [float(row["time"]) - 1_700_000_000.0 for row in rows] == pytest.approx([0.0, 0.25, 0.55, 0.75, 1.6,
                                                                                   1.76, 1.86], abs=1e-3)
    assert result.samples == 7


def test_stop_is_prompt_idempotent_and_final(tmp_path: Path) -> None:
    """A 30 s interval: stop() returns at once with the first row and a final one; a second stop() changes nothing."""
    path = tmp_path / "node-0.csv"
    monitor = NodeMonitor(path, 30.0, [os.getpid()], "h", 0)
    began = time.monotonic()
    monitor.start()
    _wait_for_rows(path, 1)
    first_seen = time.monotonic()  # after the clock's start
    time.sleep(0.3)  # a gap for the final row to show, not a bound
    stopping = time.monotonic()
    result = monitor.stop()
    stopped = time.monotonic()
    _, rows = _rows(path)
    assert result.samples == len(rows) == 2
    # The final row was taken inside stop(), on a clock started between began and first_seen (3 decimals)...
    final = float(rows[1]["elapsed_s"])
    assert stopping - first_seen - 0.0005 <= final <= stopped - began + 0.0005
    # ...before the first deadline: stop() ended the 30 s wait (a wait left to run ends at 30 s or later).
    assert final < 30.0 and stopped - began < 30.0
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
        assert monitor.stop().samples == 0  # stop() joins the thread: its warning came before


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
