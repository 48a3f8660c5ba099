"""``--profile START:COUNT``: the PyTorch profiler over a window of optimiser steps, per rank.

Steps are counted as in ``metrics.jsonl``: step k is the k-th optimiser step of the
run, so a resumed run (``first_step`` steps already done) still profiles the same
global steps. torch's profiler counts its own steps from 0 at ``start()``: its
``ProfilerStep#k`` annotation covers global step ``first_step + 1 + k``. To spare
readers that arithmetic each recorded step also carries a ``nodescale.step#G``
annotation with its global number, and the trace's ``nodescale`` metadata says both.

Outside the window the cost is nil (a window already past creates no profiler at
all) or one cheap ``profile.step()`` call per step while waiting for it.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nodescale.atomic_files import sync_directory, write_json_atomic, write_text_atomic

TOP_OPS = 30  # rows of the operator table and JSON: enough to see where the time goes, small enough to read
STEP_ANNOTATION = "nodescale.step#"


@dataclass
class ProfileResult:
    """What one rank's profiler wrote."""

    trace: Path  # RUN/profile/rank{R}.trace.json (Chrome / Perfetto)
    table: Path  # RUN/profile/rank{R}.ops.txt (human-readable, key_averages table)
    ops: Path  # RUN/profile/rank{R}.ops.json (machine-readable top operators)
    steps: tuple[int, int]  # (first, last) optimiser step actually profiled


class StepProfiler:
    """Run ``torch.profiler`` over global optimiser steps ``start .. start + count - 1`` of this rank."""

    def __init__(self, start: int, count: int, first_step: int, out_dir: Path, rank: int,
                 device: torch.device) -> None:
        """first_step: the number of optimiser steps already done when training (re)starts (0 on a fresh run;
        k after a resume at step k)."""
        if start < 1 or count < 1:
            raise ValueError(f"profile window {start}:{count}: START and COUNT must be at least 1")
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.device = device
        self.first_step = first_step
        self.requested = (start, start + count - 1)
        # The part of the window this run can still see: steps after first_step.
        self.first = max(start, first_step + 1)
        self.last = start + count - 1
        self.skipped = self.last <= first_step  # window entirely in the past: no profiler at all
        # torch's schedule counts profiler steps from 0 at start(); profiler step k = global step first_step+1+k.
        offset = self.first - first_step - 1
        self.warmup = 1 if offset >= 1 else 0  # one warm-up step before the window where the run has one
        self.wait = offset - self.warmup
        self.active_steps = self.last - self.first + 1
        self._prof: Any = None  # torch.profiler.profile while it runs; dropped once exported, to free its events
        self._annotation: Any = None  # the open nodescale.step#G record_function
        self._completed = first_step  # last global step whose step() call we saw
        self._trace_ready = False
        self._started = False
        self._stopped = False
        self._result: ProfileResult | None = None

    @property
    def active(self) -> bool:
        """True while the profiler is recording (the step now running is inside the window)."""
        return self._prof is not None and self.first <= self._completed + 1 <= self.last

    def start(self) -> None:
        """Create and start the profiler; called once before the first step of ``fit()``."""
        if self.skipped or self._started or self._stopped:
            return
        self._started = True
        from torch.profiler import ProfilerActivity, profile, schedule  # lazily: profiling is usually off

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with warnings.catch_warnings():
            # warmup=0 happens only when the run (re)starts inside the window: nothing before it to warm up on.
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            plan = schedule(wait=self.wait, warmup=self.warmup, active=self.active_steps, repeat=1)
        self._prof = profile(activities=activities, schedule=plan, on_trace_ready=self._on_trace_ready,
                             record_shapes=True, profile_memory=True, with_stack=False)
        self._prof.preset_metadata_json("nodescale", json.dumps({
            "rank": self.rank, "requested_steps": list(self.requested), "first_step": self.first_step,
            "profiler_step_to_global_step": f"global = ProfilerStep#k + {self.first_step + 1}",
        }))
        self._prof.__enter__()
        self._open_annotation()

    def step(self, global_step: int) -> None:
        """Advance the schedule; called right after each optimiser step with the number of the step just done."""
        if self._prof is None:
            return
        self._close_annotation()
        self._completed = global_step
        self._prof.step()
        if self._trace_ready:  # the window's last step just finished: write now, not at the end of training
            self._finish()
        else:
            self._open_annotation()

    def stop(self) -> ProfileResult | None:
        """Stop (also early, also after a failure) and return what was written; the same answer on every call."""
        if self._stopped:
            return self._result
        self._stopped = True
        if self._prof is not None:
            self._close_annotation()
            self._finish()
        return self._result

    # --- internals -------------------------------------------------------------------------------------------

    def _on_trace_ready(self, _prof: Any) -> None:
        # Only note it: exporting inside torch's state transition would leave the profiler half-switched
        # if writing failed. step() and stop() export right after torch returns.
        self._trace_ready = True

    def _open_annotation(self) -> None:
        if self.active:
            from torch.profiler import record_function

            self._annotation = record_function(f"{STEP_ANNOTATION}{self._completed + 1}")
            self._annotation.__enter__()

    def _close_annotation(self) -> None:
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None

    def _finish(self) -> None:
        """Stop torch's profiler (which fires on_trace_ready if it was recording) and export what it holds."""
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        last = min(self._completed, self.last)
        # Recorded but no step of the window completed (training ended just before or inside its first step):
        # the trace would hold no whole step, so there is nothing worth reporting.
        if self._trace_ready and last >= self.first:
            self._result = self._export(prof, (self.first, last))

    def _export(self, prof: Any, steps: tuple[int, int]) -> ProfileResult:
        name = f"rank{self.rank}"
        result = ProfileResult(self.out_dir / f"{name}.trace.json", self.out_dir / f"{name}.ops.txt",
                               self.out_dir / f"{name}.ops.json", steps)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        _export_trace_atomic(prof, result.trace)
        on_device = self.device.type == "cuda"
        sort_key = "self_device_time_total" if on_device else "self_cpu_time_total"
        events = prof.events()
        for event in events:  # one row for all of them in the tables, as torch does for ProfilerStep#k
            if event.name.startswith(STEP_ANNOTATION):
                event.name = STEP_ANNOTATION + "*"
        averages = events.key_averages()
        header = (f"rank {self.rank}, optimiser steps {steps[0]}-{steps[1]}, top {TOP_OPS} by "
                  f"{sort_key.replace('_', ' ')} (summed over the steps)\n")
        write_text_atomic(result.table, header + averages.table(sort_by=sort_key, row_limit=TOP_OPS) + "\n")
        # A plain list of rows, sorted as the table is (which says the rank, steps and order in its header).
        write_json_atomic(result.ops, top_ops(averages, on_device))
        return result


def top_ops(averages: Sequence[Any], on_device: bool, limit: int = TOP_OPS) -> list[dict[str, Any]]:
    """Rows of the top operators of ``profile.key_averages()``: by self device time on CUDA, else self CPU time.

    User annotations (``ProfilerStep*``, ``nodescale.step#G``, ``Optimizer.step#...``) are regions, not
    operators: their self time is Python overhead between ops, so they are left out.
    """
    ops = [avg for avg in averages if not getattr(avg, "is_user_annotation", False)]
    ops.sort(key=lambda avg: avg.self_device_time_total if on_device else avg.self_cpu_time_total, reverse=True)
    return [{
        "name": avg.key,
        "calls": avg.count,
        "cpu_time_total_us": round(float(avg.cpu_time_total), 3),
        "self_cpu_time_total_us": round(float(avg.self_cpu_time_total), 3),
        "device_time_total_us": round(float(avg.device_time_total), 3),
        "self_device_time_total_us": round(float(avg.self_device_time_total), 3),
        "cpu_memory_usage_bytes": int(avg.cpu_memory_usage),
        "self_cpu_memory_usage_bytes": int(avg.self_cpu_memory_usage),
        "device_memory_usage_bytes": int(avg.device_memory_usage),
        "self_device_memory_usage_bytes": int(avg.self_device_memory_usage),
    } for avg in ops[:limit]]


def top_ops_text(ops_json_rows: Sequence[Mapping[str, Any]] | Mapping[str, Any], limit: int = 10) -> str:
    """A compact table of the first ``limit`` rows of an ops JSON (also accepts ``{"ops": rows}``)."""
    rows = list(ops_json_rows["ops"] if isinstance(ops_json_rows, Mapping) else ops_json_rows)[:limit]
    if not rows:
        return "  (no operators recorded)"
    on_device = any(row.get("self_device_time_total_us", 0) > 0 for row in rows)
    kind = "device" if on_device else "cpu"
    width = min(60, max(len(str(row["name"])) for row in rows))
    lines = [f"  {'operator':<{width}}  {'calls':>7}  {'self ' + kind + ' ms':>12}  {kind + ' total ms':>13}  "
             f"{'memory':>10}"]
    for row in rows:
        name = str(row["name"])
        name = name if len(name) <= width else name[:width - 1] + "…"
        memory = row.get("device_memory_usage_bytes", 0) if on_device else row.get("cpu_memory_usage_bytes", 0)
        lines.append(f"  {name:<{width}}  {row['calls']:>7}  {row[f'self_{kind}_time_total_us'] / 1000:>12.3f}  "
                     f"{row[f'{kind}_time_total_us'] / 1000:>13.3f}  {_bytes(memory):>10}")
    return "\n".join(lines)


def _bytes(count: float) -> str:
    """1536 -> '1.5 KiB'; negative counts (an op that frees more than it allocates) keep their sign."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _export_trace_atomic(prof: Any, path: Path) -> None:
    """Chrome trace export to a temporary name in the same directory, then rename: never half a trace."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        prof.export_chrome_trace(str(tmp))
        with open(tmp, "rb") as handle:  # torch wrote and closed it; make its content durable before the rename
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    sync_directory(path.parent)
