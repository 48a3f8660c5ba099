"""``nodescale bench scaling``: train at each world size, one run after the other.

Each world size is an ordinary ``nodescale train --nproc N`` run in its own
directory ``OUT/ws-N`` (one after the other, so runs never share the
machine). When all have finished, :func:`run_all` hands the directory to
:mod:`nodescale.bench.scaling_results`, which tabulates the runs and writes
``OUT/scaling.json``, ``OUT/scaling.csv`` and ``OUT/scaling.png``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodescale.bench import scaling_math
from nodescale.bench.scaling_math import Mode
from nodescale.bench.scaling_results import RUN_PREFIX, collect, read_summary, write_outputs
from nodescale.engine.run_dir import make_run_dir
from nodescale.errors import UserError

# Settings nodescale bench scaling decides for every run; the user may not override them after --.
CONTROLLED_KEYS = (
    "train.batch_size", "train.max_steps", "train.timing_warmup_steps", "train.epochs", "strategy.nproc", "out",
    "checkpoint.resume", "checkpoint.at_end",
)


class TrainingFailed(Exception):
    """``nodescale train`` at one world size exited with an error; its output is in ``log``."""

    def __init__(self, world_size: int, code: int, log: Path) -> None:
        self.world_size, self.code, self.log = world_size, code, log
        super().__init__(f"training at world size {world_size} failed (exit code {code}); output in {log}")


@dataclass(frozen=True)
class ScalingPlan:
    """What to run: world sizes, mode, steps, batch, and the flags passed on to ``nodescale train``."""

    out: Path
    world_sizes: tuple[int, ...]
    mode: Mode
    batch_size: int  # strong: the global batch; weak: each process's batch
    max_steps: int
    warmup_steps: int
    train_args: tuple[str, ...] = ()  # --model, --dataset, --strategy and anything given after --

    def run_dir(self, world_size: int) -> Path:
        """Where the run at ``world_size`` writes (``OUT/ws-N``)."""
        return self.out / f"{RUN_PREFIX}{world_size}"

    def train_argv(self, world_size: int, job_out: Path | None = None) -> list[str]:
        """The ``nodescale`` arguments that train at ``world_size``; with ``job_out``, those of a cluster job
        writing there, whose launcher starts the processes (no ``--nproc``)."""
        batch = scaling_math.per_process_batch(self.batch_size, world_size, self.mode)
        nproc = [] if job_out else ["--nproc", str(world_size)]
        return [
            "train", *self.train_args,
            *nproc, "--batch-size", str(batch), "--max-steps", str(self.max_steps),
            "--set", f"train.timing_warmup_steps={self.warmup_steps}",
            # --max-steps, not the epoch count, must end every run, whatever the dataset's size.
            "--epochs", "1000000",
            # The final checkpoint is not timed but costs wall time and disk; a benchmark needs none.
            "--set", "checkpoint.at_end=false",
            "--no-progress", "--out", str(job_out or self.run_dir(world_size)),
        ]


def check_train_args(args: Sequence[str], flag_names: dict[str, str]) -> None:
    """Refuse flags after ``--`` that would change what the benchmark controls (batch, steps, processes...)."""
    controlled = {flag_names[key]: key for key in CONTROLLED_KEYS if key in flag_names}
    for index, token in enumerate(args):
        name, _, inline = token.partition("=")
        key = controlled.get(name)
        if name == "--set":  # --set KEY=VALUE or --set=KEY=VALUE
            assignment = inline or (args[index + 1] if index + 1 < len(args) else "")
            assigned = assignment.partition("=")[0].strip()
            key = assigned if assigned in CONTROLLED_KEYS else None
        if key is not None:
            raise UserError(f"train flag {token!r} after --", "is set by nodescale bench scaling for every run",
                            "use --batch-size, --max-steps, --warmup-steps or --world-sizes of bench scaling")


def local_capacity() -> tuple[int, str]:
    """How many processes this machine runs without sharing a device: its GPUs, or else its CPU cores."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), "GPUs"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores, "CPU cores"


def default_world_sizes() -> list[int]:
    """1, 2, 4, ... up to this machine's GPUs (or CPU cores), and at least ``[1, 2]``."""
    capacity, _ = local_capacity()
    sizes = [1]
    while sizes[-1] * 2 <= max(2, capacity):
        sizes.append(sizes[-1] * 2)
    return sizes


def run_world_size(plan: ScalingPlan, world_size: int) -> dict[str, Any]:
    """Train at ``world_size`` in a child ``nodescale train``; return its summary.

    The child's output goes to ``OUT/ws-N/train.log``. A child that fails
    raises :class:`TrainingFailed`.
    """
    run_dir = plan.run_dir(world_size)
    make_run_dir(run_dir)  # marked as nodescale's before train.log goes in: the child's run directory
    log = run_dir / "train.log"
    command = [sys.executable, "-m", "nodescale", *plan.train_argv(world_size)]
    with open(log, "w", encoding="utf-8") as handle:
        handle.write(f"$ nodescale {' '.join(command[3:])}\n")
        handle.flush()
        code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if code != 0:
        raise TrainingFailed(world_size, code, log)
    return read_summary(run_dir)


def cpu_threads_note(cores: int) -> str:
    """How the cores were shared among the processes of a CPU run (nodescale train's thread rule)."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        return (f"CPU runs with OMP_NUM_THREADS={threads}: every process used {threads} thread(s), so N processes "
                f"used up to N x {threads} of the {cores} cores")
    return (f"CPU runs: 1 process used all {cores} cores through threads, N processes cores / N threads each "
            "(nodescale train's OMP_NUM_THREADS), so the cores in use are the same at every world size; set "
            "OMP_NUM_THREADS=1 to measure one core per process")


def load_average() -> float | None:
    """This machine's 1-minute load average (runnable processes), or ``None`` where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def run_all(plan: ScalingPlan, echo: Callable[[str], None], peak_choice: str = "auto") -> dict[str, Any]:
    """Train every world size of ``plan`` in turn, then collect and write the result."""
    capacity = local_capacity()
    loads = {}
    for world_size in plan.world_sizes:
        loads[world_size] = load_average()
        summary = run_world_size(plan, world_size)
        throughput, step = summary.get("samples_per_second"), summary.get("step_seconds")
        shown = "nothing timed" if throughput is None else f"{throughput:,.1f} samples/s, {step * 1000:,.2f} ms/step"
        echo(f"  world size {world_size}: {shown}")
    result = collect(plan.out, plan.mode, peak_choice, capacity, plan.world_sizes)
    result["commands"] = {str(n): f"nodescale {' '.join(plan.train_argv(n))}" for n in plan.world_sizes}
    for row in result["rows"]:
        row["load_average_before"] = loads[row["world_size"]]
    if str(result["device"]).startswith("cpu"):
        result["notes"].append(cpu_threads_note(capacity[0]))
    busy = [f"{n} ({load:.1f})" for n, load in loads.items() if load is not None and load > capacity[0]]
    if capacity[1] == "CPU cores" and busy:
        # Other processes on the cores distort a CPU benchmark far more than the world size does.
        result["notes"].append(
            f"the machine was busy before world size {', '.join(busy)}: 1-minute load average against "
            f"{capacity[0]} cores; other processes competed for the CPU, so the numbers are noisy"
        )
    write_outputs(plan.out, result)
    return result
