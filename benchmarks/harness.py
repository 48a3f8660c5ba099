"""What every benchmark repeats, in one place: running sides fairly, comparing them, keeping the figures.

* ``child_env``: the environment of every side (same threads, the working tree's nodescale,
  no launcher variables inherited from a job this script may itself run in);
* ``run_logged``: one side as a subprocess in a session of its own, its output in a log,
  killed whole at a time limit or on Ctrl-C, timed until its last process has exited;
* ``interleave``: the run order of repeated A/B(/C...) sides, rotated every repeat so that a
  drift of a shared machine's load favours no side (``PAIRS`` repeats by default where a
  ratio is judged against a target);
* ``result_line``, ``nodescale_summary``: a hand-written side's result (the JSON on its ``RESULT``
  line) and a ``nodescale train`` run's (its summary.json);
* ``compare``: medians, best runs, their ratios, the spread of each side, the paired ratios;
* ``machine``, ``write_results``: the results file, written atomically with the machine's facts.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SRC = REPO / "src"
# The working tree's nodescale, whatever is installed: that is the code being measured.
sys.path.insert(0, str(SRC))

from nodescale.atomic_files import write_json_atomic  # noqa: E402

PAIRS = 8  # default repeats of each side where a ratio is judged: one pair is noise on a shared machine
RESULT_PREFIX = "RESULT "  # what the hand-written sides print before their JSON result
LEFTOVER_WAIT_S = 60.0  # how long a finished command's leftover processes may take to exit

# Variables a launcher sets in its workers. If a benchmark itself runs inside a distributed
# job, nodescale would take them as its own rank and torchrun would join a stale rendezvous.
LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
)

T = TypeVar("T")


# ---------------------------------------------------------------------- running
def child_env(threads: int | None, **extra: str) -> dict[str, str]:
    """The environment of every side: ``OMP_NUM_THREADS`` (None: inherited), the working tree's
    ``src`` first on ``PYTHONPATH``, no launcher variables, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    if threads is not None:
        # Set for every side: nodescale's launcher would otherwise pick cores // nproc and
        # torchrun 1, a difference that has nothing to do with what is compared.
        env["OMP_NUM_THREADS"] = str(threads)
    return {**env, **extra}


@dataclass
class Finished:
    """A command that has run: its exit code (None: killed at its time limit), start and wall time."""

    cmd: list[str]
    log: Path
    code: int | None
    launched: float  # unix time just before it started
    wall_seconds: float  # until no process of its session was left

    def check(self) -> Finished:
        """Itself if it succeeded; else a RuntimeError with the command and its log's tail."""
        if self.code != 0:
            what = "killed at its time limit" if self.code is None else f"exit code {self.code}"
            raise RuntimeError(f"{what}: {shlex.join(self.cmd)}\n{log_tail(self.log)}")
        return self


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout: float | None = None) -> Finished:
    """Run ``cmd`` from the repository root with its output in ``log``; kill its whole session
    (compile workers, ranks) at ``timeout`` seconds or on an exception such as Ctrl-C."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as handle:
        handle.write("$ " + shlex.join(cmd) + "\n")
        handle.flush()
        launched, started = time.time(), time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
        code: int | None = None
        try:
            code = proc.wait(timeout=None if timeout is None else max(1.0, timeout))
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                kill_session(proc.pid)  # SIGKILL: nodescale takes SIGTERM as "checkpoint, then stop"
                proc.wait()
        # A process the command leaves behind (Lightning's second rank may outlive the first
        # by a moment) is still part of the job's time.
        left = LEFTOVER_WAIT_S if timeout is None else max(0.0, timeout - (time.perf_counter() - started))
        deadline = time.perf_counter() + min(LEFTOVER_WAIT_S, left)
        while session_members(proc.pid) and time.perf_counter() < deadline:
            time.sleep(0.01)
        wall = time.perf_counter() - started
        kill_session(proc.pid)
    return Finished(cmd, log, code, launched, wall)


def kill_session(session: int) -> None:
    """SIGKILL every process still in ``session`` (a session id is its leader's pid)."""
    try:
        os.killpg(session, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def session_members(session: int) -> list[int]:
    """Processes still in ``session`` (Linux /proc; empty elsewhere)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[-1].split()  # after "(comm)": state ppid pgrp session
        except OSError:
            continue
        if len(fields) > 3 and fields[3] == str(session):
            members.append(int(stat.parent.name))
    return members


def log_tail(log: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of ``log`` ('' if unreadable)."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def result_line(log: Path, prefix: str = RESULT_PREFIX) -> dict[str, Any]:
    """The JSON object on the last line of ``log`` that starts with ``prefix``."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    raise RuntimeError(f"no {prefix.strip()} line in {log}:\n{log_tail(log)}")


def nodescale_summary(run_dir: Path) -> dict[str, Any]:
    """A ``nodescale train`` run's summary.json, refused if its step time includes the warm-up."""
    data: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    if data.get("timing_includes_warmup"):
        raise RuntimeError(f"{run_dir}: nodescale timed its warm-up too; use more --steps")
    return data


def rotated(sides: Sequence[str], turn: int) -> list[str]:
    """``sides`` rotated left by ``turn`` places."""
    turn %= len(sides)
    return [*sides[turn:], *sides[:turn]]


def interleave(repeats: int, groups: Sequence[T], sides: Sequence[str]) -> list[tuple[int, T, list[str]]]:
    """``(repeat, group, sides in run order)`` in run order: every repeat runs each group's sides
    back to back, rotated one place per repeat and per group, so that each side takes each
    position equally often (over a multiple of ``len(sides)`` repeats) and drift favours none."""
    return [(repeat, group, rotated(sides, repeat + index))
            for repeat in range(repeats) for index, group in enumerate(groups)]


# ---------------------------------------------------------------------- analysis
def compare(base: str, base_values: Mapping[int, float], other: str, other_values: Mapping[int, float],
            unit: str, higher_is_better: bool = False) -> dict[str, Any]:
    """Two sides' figures by repeat: for each side the values, median, best and spread
    ((max - min) / median), keyed ``{side}_{unit}...``; ``ratio`` (other/base of the medians),
    ``ratio_of_minima`` (or ``_maxima``: the best runs, least disturbed by other tenants' load,
    which only ever slows a run), the ratios within each repeat (whose runs ran back to back, so
    slow drift cancels) and in how many repeats ``other`` was the worse one (a sign test)."""
    best, best_name = (max, "max") if higher_is_better else (min, "min")
    found: dict[str, Any] = {}
    for side, values in ((base, base_values), (other, other_values)):
        vals = list(values.values())
        median = statistics.median(vals) if vals else None
        found[f"{side}_{unit}"] = vals
        found[f"{side}_{unit}_median"] = median
        found[f"{side}_{unit}_{best_name}"] = best(vals) if vals else None
        found[f"{side}_spread"] = (max(vals) - min(vals)) / median if vals and median else None
    b_med, o_med = found[f"{base}_{unit}_median"], found[f"{other}_{unit}_median"]
    b_best, o_best = found[f"{base}_{unit}_{best_name}"], found[f"{other}_{unit}_{best_name}"]
    paired = [value / base_values[r] for r, value in other_values.items() if base_values.get(r)]
    found["ratio"] = o_med / b_med if b_med and o_med is not None else None
    found[f"ratio_of_{best_name}ima"] = o_best / b_best if b_best and o_best is not None else None
    found["paired_ratios"] = paired
    found[f"{other}_slower_pairs"] = sum((p < 1.0) if higher_is_better else (p > 1.0) for p in paired)
    return found


def span(values: Sequence[float]) -> str:
    """``min-max`` of ratios for a table cell, '-' when there are none."""
    return f"{min(values):.3f}-{max(values):.3f}" if values else "-"


# ----------------------------------------------------------------------- results
def wide_console(width: int) -> Console:
    """A rich console; writing to a log file or a pipe, ``width`` columns, so a table's rows stay on one line."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = width
    return console


def cpu_model() -> str:
    """The processor's name as Linux reports it ("unknown" elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def machine(*packages: str) -> dict[str, Any]:
    """The machine's facts for a results file: CPU, cores, load, versions of torch and of ``packages``,
    and the GPUs as nvidia-smi names them (the harness never initialises CUDA itself)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch  # versions only: the sides import it themselves

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
    }
    for name in packages:
        try:
            info[f"{name}_version"] = version(name)
        except PackageNotFoundError:
            info[f"{name}_version"] = None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=True).stdout
            info["nvidia_smi"] = [line.strip() for line in out.splitlines() if line.strip()]
        except (subprocess.SubprocessError, OSError) as exc:
            info["nvidia_smi"] = f"failed: {exc}"
    return info


def write_results(out: Path, info: dict[str, Any], body: dict[str, Any], console: Console | None = None) -> None:
    """Write ``{date, command, machine, **body}`` to ``out`` atomically (a killed benchmark leaves
    the previous file whole); say where on ``console`` if given."""
    record = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "machine": info,
        **body,
    }
    write_json_atomic(out, record)
    if console is not None:
        console.print(f"wrote {out}")
