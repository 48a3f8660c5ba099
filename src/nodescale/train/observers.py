"""A rank's ``--monitor`` and ``--profile``: started around the training loop, their results put into the summary.

Neither touches the step when switched off; the monitor never does (a thread
on one process per node), the profiler only over its window of steps.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nodescale.config.schema import RunConfig, profile_window
from nodescale.distributed.process_group import Runtime, gather_from_all
from nodescale.train.console import Console

if TYPE_CHECKING:  # imported when switched on: psutil and torch.profiler cost start-up time otherwise
    from nodescale.observe.monitor import MonitorResult, NodeMonitor
    from nodescale.observe.profiler import ProfileResult, StepProfiler

MONITOR_DIR = "monitor"
PROFILE_DIR = "profile"


class Observers:
    """The monitor of this node (on its local rank 0) and this rank's profiler, as the run asked."""

    def __init__(self, cfg: RunConfig, runtime: Runtime, run_dir: Path) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.run_dir = run_dir
        self.monitor: NodeMonitor | None = None
        self.profiler: StepProfiler | None = None

    def start(self, global_step: int) -> StepProfiler | None:
        """Start what was asked for, the profiler (returned) from ``global_step`` on; a collective when
        --monitor is on (every rank says where it runs)."""
        observe = self.cfg.observe
        if observe.monitor:
            pids, gpus = self._node_processes()
            if self.runtime.is_local_main:
                from nodescale.observe.monitor import NodeMonitor

                node = self.runtime.env.node_rank
                path = self.run_dir / MONITOR_DIR / f"node-{node}.csv"
                path.parent.mkdir(parents=True, exist_ok=True)
                self.monitor = NodeMonitor(path, observe.monitor_interval_s, pids, socket.gethostname(), node,
                                           cuda_devices=",".join(gpus) if gpus else None)
                self.monitor.start()
        if observe.profile:
            from nodescale.observe.profiler import StepProfiler

            first, count = profile_window(observe.profile)
            self.profiler = StepProfiler(first, count, global_step, self.run_dir / PROFILE_DIR,
                                         self.runtime.rank, self.runtime.device)
            self.profiler.start()
        return self.profiler

    def _node_processes(self) -> tuple[list[int], list[str]]:
        """The process ids of this node's ranks, and the UUIDs of their NVIDIA GPUs (one all-gather).

        The UUIDs let local rank 0 sample every rank's GPU even where each rank sees only its own
        (Slurm --gpus-per-task, per-rank CUDA_VISIBLE_DEVICES wrappers).
        """
        mine = (self.runtime.env.node_rank, os.getpid(), _nvidia_uuid(self.runtime.device))
        here = [entry for entry in gather_from_all(self.runtime, mine) if entry[0] == self.runtime.env.node_rank]
        uuids = [uuid for _, _, uuid in here]
        return [pid for _, pid, _ in here], (list(dict.fromkeys(uuids)) if all(uuids) else [])

    def stop(self, console: Console) -> dict[str, Any]:
        """Stop both and return what goes into summary.json (a collective when --monitor is on)."""
        result: dict[str, Any] = {}
        profiled = self.profiler.stop() if self.profiler is not None else None
        if profiled is not None:
            result["profile"] = self._describe_profile(profiled, console)
        if self.cfg.observe.monitor:
            mine = self.monitor.stop() if self.monitor is not None else None
            everyone = gather_from_all(self.runtime, mine)
            result.update(self._describe_monitors([m for m in everyone if m is not None]))
        return result

    def abort(self) -> None:
        """After a failure: stop the sampler thread and the profiler without talking to other ranks."""
        for stop in (self.monitor.stop if self.monitor else None, self.profiler.stop if self.profiler else None):
            if stop is not None:
                try:
                    stop()
                except Exception:  # noqa: BLE001 - the failure being handled matters more
                    pass

    def _describe_profile(self, profiled: ProfileResult, console: Console) -> dict[str, Any]:
        if self.runtime.is_main:
            from nodescale.observe.profiler import top_ops_text

            first, last = profiled.steps
            console.print(f"profile of steps {first}-{last} (rank 0), top operators; all ranks' traces and "
                          f"tables in {profiled.trace.parent}:")
            console.print(top_ops_text(json.loads(profiled.ops.read_text())))
        return {"steps": list(profiled.steps), "dir": str(profiled.trace.parent.relative_to(self.run_dir))}

    def _describe_monitors(self, results: list[MonitorResult]) -> dict[str, Any]:
        energies = [r.energy_joules for r in results if r.energy_joules is not None]
        return {
            "monitor": {
                "interval_s": self.cfg.observe.monitor_interval_s,
                "files": sorted(str(r.path.relative_to(self.run_dir)) for r in results),
                "samples": sum(r.samples for r in results),
                "devices": [name for r in results for name in r.devices],
                "sampler_cpu_seconds": sum(r.cpu_seconds for r in results),  # what sampling cost, all nodes
            },
            # Energy only where every node's devices reported it: a partial sum would mislead.
            "energy_joules": sum(energies) if results and len(energies) == len(results) else None,
        }


def _nvidia_uuid(device: torch.device) -> str | None:
    """``GPU-<uuid>`` of this rank's NVIDIA GPU (as NVML names it); None on the CPU and on ROCm."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
