"""``--monitor``: a background sampler of one node's host and devices, one CSV row per interval.

One process per node (local rank 0) runs a :class:`NodeMonitor`: a daemon
thread that wakes on a drift-free schedule, reads the host through psutil,
the training processes of the node by pid and the visible GPUs through a
:mod:`~nodescale.observe.device_readers` reader, and appends a row to
``RUN/monitor/node-N.csv``. It never touches the training loop: nothing is
shared with it but the pids, and no failure of the sampler reaches training.
"""

from __future__ import annotations

import csv
import math
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import psutil

from nodescale.observe.device_parsing import DeviceSample
from nodescale.observe.device_readers import DeviceReader, detect_reader

# Fixed columns of every row, then DEVICE_FIELDS once per device as gpu{i}_<field>.
HOST_COLUMNS: tuple[str, ...] = (
    "time",  # unix seconds
    "elapsed_s",  # since the first sample, monotonic clock
    "host",
    "node_rank",
    "cpu_percent",  # whole node, 0-100 (psutil's system-wide figure); empty in the first row (no interval yet)
    "procs_cpu_percent",  # the training processes, summed; 100 = one core busy; empty in the first row
    "procs_rss_bytes",
    "host_mem_used_bytes",  # total - available: what the page cache cannot give back
    "host_mem_total_bytes",
)
DEVICE_FIELDS: tuple[str, ...] = ("util_percent", "mem_used_bytes", "mem_total_bytes", "temp_c", "power_w",
                                  "energy_j")  # energy_j: cumulative since the monitor's first sample


def device_columns(count: int) -> list[str]:
    """The per-device column names for ``count`` devices, in file order."""
    return [f"gpu{index}_{field}" for index in range(count) for field in DEVICE_FIELDS]


@dataclass
class MonitorResult:
    """What one node's monitor recorded (picklable: the ranks gather these for summary.json)."""

    path: Path  # the CSV written
    samples: int  # rows written
    interval_s: float
    devices: list[str]  # e.g. ["cuda:0 NVIDIA H100 80GB HBM3"]; [] on CPU-only nodes
    # Device energy over the sampled period, summed over this node's devices; None when a device (or every
    # device) reports no energy counter: a sum over some of them would read as the node's and mislead.
    energy_joules: float | None
    cpu_seconds: float = 0.0  # CPU time the sampler thread used: what monitoring cost this node


class _Energy:
    """Turns a device's raw energy counter into joules since the first reading.

    Only forward steps are added, so a counter that resets or wraps (a driver
    reload, a 32-bit counter on older AMD firmware) loses one interval, not the run.
    """

    def __init__(self) -> None:
        self.last: float | None = None
        self.total: float | None = None

    def add(self, counter: float | None) -> float | None:
        if counter is None:
            return None
        if self.last is None:
            self.total = 0.0
        elif counter >= self.last and self.total is not None:
            self.total += counter - self.last
        self.last = counter
        return self.total


class NodeMonitor:
    """Samples this node at ``interval_s`` into ``path`` from a daemon thread, from :meth:`start` to :meth:`stop`.

    ``pids`` are the node's training processes (their CPU and resident memory
    are summed; one that exits is dropped). Each sample is a handful of reads
    of /proc plus the device reader's calls. Rows are written whole and
    flushed one by one, so a crash of the run leaves a readable file.
    """

    def __init__(self, path: Path, interval_s: float, pids: Sequence[int], host: str, node_rank: int,
                 cuda_devices: str | None = None) -> None:
        """``cuda_devices``: the NVIDIA GPUs to sample, as a CUDA_VISIBLE_DEVICES value (indices or UUIDs);
        None: those this process's CUDA_VISIBLE_DEVICES shows. Under per-rank GPU masks (Slurm
        --gpus-per-task) the caller passes the UUIDs of all the node's ranks' GPUs."""
        if not interval_s > 0:
            raise ValueError(f"monitor interval must be positive, got {interval_s}")
        self.path = Path(path)
        self.interval_s = float(interval_s)
        self.pids = list(pids)
        self.host = host
        self.node_rank = node_rank
        self.cuda_devices = cuda_devices
        self._cpu_seconds = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._result: MonitorResult | None = None
        # Owned by the sampler thread once it runs; read by stop() only after joining it.
        self._reader: DeviceReader | None = None
        self._devices: list[str] = []
        self._energy: list[_Energy] = []
        self._procs: list[psutil.Process] = []
        self._handle: TextIO | None = None
        self._writer: Any = None
        self._samples = 0
        self._first = True
        self._warned: set[str] = set()

    def start(self) -> None:
        """Start the sampler thread; it takes its first sample at once. A second call does nothing."""
        with self._lock:
            if self._thread is not None or self._result is not None:
                return
            self._thread = threading.Thread(target=self._run, name=f"nodescale-monitor-{self.node_rank}",
                                            daemon=True)  # a daemon never keeps a finished run alive
            self._thread.start()

    def stop(self) -> MonitorResult:
        """Take a final sample, join the thread, close the file and say what was recorded; idempotent."""
        with self._lock:
            if self._result is not None:
                return self._result
            self._stop.set()
            if self._thread is not None:
                # A device tool stuck mid-sample is bounded by its own timeout; the wait here is a backstop.
                self._thread.join(timeout=30.0)
            self._result = MonitorResult(self.path, self._samples, self.interval_s, list(self._devices),
                                         self._energy_total(), self._cpu_seconds)
            return self._result

    # --- the sampler thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        began = time.thread_time()
        try:
            if not self._open():
                return
            origin = time.monotonic()
            tick = 0
            while True:
                self._sample(origin)
                # The next deadline is origin + k * interval, never "now + interval": rows stay on the grid
                # however long a sample took, and a sample that overran skips the ticks it missed.
                now = time.monotonic()
                tick = max(tick + 1, math.floor((now - origin) / self.interval_s) + 1)
                if self._stop.wait(origin + tick * self.interval_s - now):
                    break
            self._sample(origin)  # the final one: energy and memory up to the end of the run
        except Exception as exc:  # noqa: BLE001 - whatever happens here, training goes on
            self._warn_once("thread", f"the node monitor stopped ({type(exc).__name__}: {exc})")
        finally:
            self._close()
            self._cpu_seconds = time.thread_time() - began

    def _open(self) -> bool:
        """Find the devices, attach to the processes and write the header; False (with a warning) if impossible."""
        self._reader = detect_reader(self.cuda_devices)
        if self._reader is not None:
            try:
                self._devices = self._reader.names()
            except Exception:  # noqa: BLE001 - a reader that cannot name its devices is no reader
                self._reader.close()
                self._reader, self._devices = None, []
        self._energy = [_Energy() for _ in self._devices]
        for pid in self.pids:
            try:
                self._procs.append(psutil.Process(pid))
            except psutil.Error:  # gone already, or not ours to see
                continue
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.path, "w", newline="", buffering=1)  # line-buffered: whole rows reach disk
            self._writer = csv.writer(self._handle, lineterminator="\n")
            self._writer.writerow([*HOST_COLUMNS, *device_columns(len(self._devices))])
        except OSError as exc:
            self._warn_once("open", f"the node monitor cannot write {self.path} ({exc}); nothing is recorded")
            return False
        return True

    def _sample(self, origin: float) -> None:
        """Append one row; a part that fails leaves empty cells (and one warning), a failed write ends the thread."""
        elapsed = time.monotonic() - origin
        row: list[Any] = [f"{time.time():.3f}", f"{elapsed:.3f}", self.host, self.node_rank]
        try:
            row += self._host_cells()
        except Exception as exc:  # noqa: BLE001
            self._warn_once("host", f"the node monitor could not read the host ({type(exc).__name__}: {exc})")
            row += [""] * (len(HOST_COLUMNS) - 4)
        row += self._device_cells()
        self._first = False
        self._writer.writerow(row)  # an OSError here (disk full) ends the thread through _run
        self._handle.flush()
        self._samples += 1

    def _host_cells(self) -> list[Any]:
        # psutil measures CPU over the time since the previous call (per thread, per Process object):
        # the first call has no interval behind it, so its figure is left empty rather than made up.
        cpu = psutil.cpu_percent(interval=None)
        procs_cpu, rss = 0.0, 0
        for proc in list(self._procs):
            try:
                with proc.oneshot():
                    procs_cpu += proc.cpu_percent(interval=None)
                    rss += proc.memory_info().rss
            except psutil.Error:  # exited (or a zombie): it no longer uses anything
                self._procs.remove(proc)
        memory = psutil.virtual_memory()
        first = self._first
        return ["" if first else f"{cpu:.1f}", "" if first else f"{procs_cpu:.1f}", rss,
                memory.total - memory.available, memory.total]

    def _device_cells(self) -> list[Any]:
        count = len(self._devices)
        if self._reader is None or not count:
            return []
        try:
            samples = self._reader.sample()
        except Exception as exc:  # noqa: BLE001
            self._warn_once("device", f"the node monitor could not read the devices ({type(exc).__name__}: {exc})")
            samples = []
        if len(samples) != count:
            samples = [DeviceSample()] * count
        cells: list[Any] = []
        for sample, energy in zip(samples, self._energy, strict=True):
            cells += [_cell(sample.util_percent, 1), _cell(sample.mem_used_bytes), _cell(sample.mem_total_bytes),
                      _cell(sample.temp_c, 1), _cell(sample.power_w, 2), _cell(energy.add(sample.energy_j), 3)]
        return cells

    def _energy_total(self) -> float | None:
        totals = [energy.total for energy in self._energy]
        if not totals or any(total is None for total in totals):
            return None
        return float(sum(total for total in totals if total is not None))

    def _close(self) -> None:
        if self._handle is not None:
            try:
                self._handle.close()
            except OSError:
                pass
        if self._reader is not None:
            try:
                self._reader.close()
            except Exception:  # noqa: BLE001
                pass

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=2)


def _cell(value: float | int | None, digits: int | None = None) -> str:
    if value is None:
        return ""
    return str(int(value)) if digits is None else f"{value:.{digits}f}"
