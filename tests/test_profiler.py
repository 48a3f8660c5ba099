"""``StepProfiler``: the real torch.profiler around a little training loop, one process and two (gloo, DDP)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conftest import cli_env, once_more_if_torch_crashed
from nodescale.observe.profiler import ProfileResult, StepProfiler, top_ops_text

CPU = torch.device("cpu")
LINEARS = 2  # each forward runs aten::addmm once per Linear (backward uses aten::mm): calls = steps * LINEARS


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 4, 3), nn.Flatten(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 1))


def _train(profiler: StepProfiler, first_step: int, last_step: int, model: nn.Module | None = None) -> list[tuple]:
    """Optimiser steps first_step+1 .. last_step as a trainer runs them; (step, active, torch profiling) per step."""
    model = model if model is not None else _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    profiler.start()
    for step in range(first_step + 1, last_step + 1):
        seen.append((step, profiler.active, torch.autograd._profiler_enabled()))
        x = torch.randn(8, 2, 8)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        profiler.step(step)
    return seen


def _names(trace: dict[str, Any], prefix: str) -> set[int]:
    """The numbers k of the trace's ``PREFIXk`` events (ProfilerStep#k, nodescale.step#k)."""
    return {int(event["name"][len(prefix):]) for event in trace["traceEvents"]
            if str(event.get("name", "")).startswith(prefix)}


def _ops(result: ProfileResult) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in json.loads(result.ops.read_text())}


def _check_files(result: ProfileResult, out: Path, rank: int = 0) -> dict[str, Any]:
    """The three files exist, are complete, name the rank, hold real operators; returns the parsed trace."""
    assert (result.trace, result.table, result.ops) == (out / f"rank{rank}.trace.json", out / f"rank{rank}.ops.txt",
                                                        out / f"rank{rank}.ops.json")
    assert not list(out.glob(".*tmp*"))  # the atomic writes left nothing behind
    trace = json.loads(result.trace.read_text())
    assert any(event.get("cat") == "cpu_op" for event in trace["traceEvents"])
    assert trace["nodescale"]["rank"] == rank
    rows = json.loads(result.ops.read_text())
    assert 0 < len(rows) <= 30
    times = [row["self_cpu_time_total_us"] for row in rows]
    assert times == sorted(times, reverse=True)
    by_name = {row["name"]: row for row in rows}
    assert not [name for name in by_name if name.startswith(("ProfilerStep", "nodescale.step"))]  # regions, not ops
    addmm = by_name["aten::addmm"]
    assert addmm["cpu_time_total_us"] >= addmm["self_cpu_time_total_us"] > 0
    assert addmm["cpu_memory_usage_bytes"] > 0  # profile_memory: addmm allocates its output
    table = result.table.read_text()
    first, last = result.steps
    assert f"rank {rank}, optimiser steps {first}-{last}" in table and "aten::addmm" in table and "Self CPU" in table
    return trace


def test_a_fresh_run_profiles_exactly_the_requested_steps(tmp_path: Path) -> None:
    out = tmp_path / "profile"
    profiler = StepProfiler(5, 3, 0, out, 0, CPU)
    seen = _train(profiler, 0, 12)
    # Recording during steps 5-7 only; step 4 warms up (torch's profiler object exists but is not collecting).
    assert [step for step, active, _ in seen if active] == [5, 6, 7]
    assert [step for step, _, on in seen if on] == [5, 6, 7]
    result = profiler.stop()
    assert result is not None and result.steps == (5, 7)
    trace = _check_files(result, out)
    # torch numbers its steps from 0 at start(): ProfilerStep#k is global step k + 1 on a fresh run.
    assert _names(trace, "ProfilerStep#") == {4, 5, 6}
    assert _names(trace, "nodescale.step#") == {5, 6, 7}
    ops = _ops(result)
    # Thin wrappers (aten::linear: next to no self time) may rank below the top 30; the work does not.
    assert ops["aten::addmm"]["calls"] == 3 * LINEARS
    assert ops["aten::convolution_backward"]["calls"] == 3
    text = top_ops_text(json.loads(result.ops.read_text()))
    assert "aten::addmm" in text and "self cpu ms" in text
    assert len(text.splitlines()) == 11  # header + the default 10 rows


@pytest.mark.parametrize(("first_step", "window", "steps", "torch_steps"), [
    (5, (10, 3), (10, 12), {4, 5, 6}),  # resumed before the window: still warms up on step 9
    (11, (10, 5), (12, 14), {0, 1, 2}),  # resumed inside it: the rest of it, no warm-up
    (9, (10, 2), (10, 11), {0, 1}),  # resumed right before it: nothing to warm up on
])
def test_a_resumed_run_profiles_the_same_global_steps(tmp_path: Path, first_step: int, window: tuple[int, int],
                                                      steps: tuple[int, int], torch_steps: set[int]) -> None:
    profiler = StepProfiler(*window, first_step, tmp_path, 0, CPU)
    seen = _train(profiler, first_step, 16)
    assert [step for step, active, _ in seen if active] == list(range(steps[0], steps[1] + 1))
    result = profiler.stop()
    assert result is not None and result.steps == steps
    trace = _check_files(result, tmp_path)
    assert _names(trace, "ProfilerStep#") == torch_steps
    assert {k + first_step + 1 for k in torch_steps} == set(range(steps[0], steps[1] + 1))
    assert _names(trace, "nodescale.step#") == set(range(steps[0], steps[1] + 1))
    assert trace["nodescale"]["first_step"] == first_step
    assert _ops(result)["aten::addmm"]["calls"] == (steps[1] - steps[0] + 1) * LINEARS


def test_a_window_already_past_costs_nothing_and_writes_nothing(tmp_path: Path) -> None:
    profiler = StepProfiler(10, 5, 14, tmp_path / "profile", 0, CPU)
    seen = _train(profiler, 14, 18)
    assert not [step for step, active, on in seen if active or on]
    assert profiler._prof is None  # no torch profiler object at all
    assert profiler.stop() is None
    assert not (tmp_path / "profile").exists()


def test_a_window_past_the_end_of_training_writes_what_was_recorded(tmp_path: Path) -> None:
    profiler = StepProfiler(8, 10, 0, tmp_path, 0, CPU)
    _train(profiler, 0, 11)
    assert profiler.active  # training stopped inside the window
    result = profiler.stop()
    assert not profiler.active and not torch.autograd._profiler_enabled()
    assert result is not None and result.steps == (8, 11)
    trace = _check_files(result, tmp_path)
    # The steps that ran are there; the region after the last one (opened by step(11), cut by stop()) may be too.
    assert {8, 9, 10, 11} <= _names(trace, "nodescale.step#") <= {8, 9, 10, 11, 12}
    assert _ops(result)["aten::addmm"]["calls"] == 4 * LINEARS


def test_training_ending_before_a_profiled_step_completes_writes_nothing(tmp_path: Path) -> None:
    profiler = StepProfiler(10, 5, 0, tmp_path / "profile", 0, CPU)
    _train(profiler, 0, 9)
    assert profiler.active  # step 10 would have been recorded, but never ran
    assert profiler.stop() is None
    assert not torch.autograd._profiler_enabled()
    assert not (tmp_path / "profile").exists()


def test_stop_is_idempotent_and_later_steps_are_ignored(tmp_path: Path) -> None:
    profiler = StepProfiler(2, 2, 0, tmp_path, 0, CPU)
    model = _model()
    _train(profiler, 0, 4, model)
    first = profiler.stop()
    assert first is not None and first.steps == (2, 3)
    written = {path: path.stat().st_mtime_ns for path in (first.trace, first.table, first.ops)}
    assert profiler.stop() is first
    profiler.step(5)  # a trainer that calls on after stop(): nothing happens
    assert profiler.stop() is first and not profiler.active
    assert {path: path.stat().st_mtime_ns for path in written} == written


def test_top_ops_text_takes_rows_or_the_whole_file() -> None:
    rows = [{"name": "aten::mm", "calls": 4, "cpu_time_total_us": 3000.0, "self_cpu_time_total_us": 2500.0,
             "device_time_total_us": 0.0, "self_device_time_total_us": 0.0, "cpu_memory_usage_bytes": 2048,
             "device_memory_usage_bytes": 0}]
    text = top_ops_text(rows)
    assert text == top_ops_text({"ops": rows})
    assert "aten::mm" in text and "2.500" in text and "3.000" in text and "2.0 KiB" in text
    on_device = [dict(rows[0], self_device_time_total_us=1500.0, device_time_total_us=1800.0,
                      device_memory_usage_bytes=1 << 20)]
    assert "self device ms" in top_ops_text(on_device) and "1.500" in top_ops_text(on_device)
    assert "1.0 MiB" in top_ops_text(on_device)
    assert "no operators" in top_ops_text([])


def test_a_bad_window_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        StepProfiler(3, 0, 0, tmp_path, 0, CPU)


DDP_SCRIPT = """
import json, sys
from pathlib import Path
import torch, torch.distributed as dist
from torch import nn
from nodescale.observe.profiler import StepProfiler

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
profiler = StepProfiler(3, 2, 0, Path(sys.argv[1]), rank, torch.device("cpu"))
profiler.start()
for step in range(1, 7):
    loss = model(torch.randn(8, 16) + rank).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    profiler.step(step)
result = profiler.stop()
Path(sys.argv[1]).with_name(f"steps{rank}.json").write_text(json.dumps(list(result.steps)))  # stdout interleaves
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_every_rank_of_a_ddp_run_writes_its_own_profile(tmp_path: Path) -> None:
    script = tmp_path / "ddp_profile.py"
    script.write_text(DDP_SCRIPT)

    def attempt(number: int) -> subprocess.CompletedProcess[str]:
        out = tmp_path / f"attempt{number}" / "profile"
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(script), str(out)], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                              timeout=120)

    run = once_more_if_torch_crashed(attempt)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    out = Path(run.args[-1])
    assert [json.loads((out.parent / f"steps{rank}.json").read_text()) for rank in (0, 1)] == [[3, 4], [3, 4]]
    assert sorted(path.name for path in out.iterdir()) == [
        f"rank{rank}.{kind}" for rank in (0, 1) for kind in ("ops.json", "ops.txt", "trace.json")]
    for rank in (0, 1):
        result = ProfileResult(out / f"rank{rank}.trace.json", out / f"rank{rank}.ops.txt",
                               out / f"rank{rank}.ops.json", (3, 4))
        trace = _check_files(result, out, rank)
        assert _names(trace, "ProfilerStep#") == {2, 3} and _names(trace, "nodescale.step#") == {3, 4}
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
        # DDP's gradient all-reduce over gloo is in each rank's trace.
        assert any("allreduce" in str(event.get("name", "")).lower() for event in trace["traceEvents"])
        assert _ops(result)["aten::addmm"]["calls"] == 2 * LINEARS
