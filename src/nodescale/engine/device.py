"""Device synchronisation and memory readings for honest figures.

CUDA runs asynchronously, so host timestamps mean nothing until the device has
caught up; the run's clock (``engine/run_record.py``) synchronises only where it
reads the time, never per step.
"""

from __future__ import annotations

import os
import resource
import sys

import torch


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """The peak memory of this process and what it measures."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (rss if sys.platform == "darwin" else rss * 1024), "host_peak_rss"


def current_memory_bytes(device: torch.device) -> int:
    """This process's memory now: CUDA memory allocated, or the resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:  # Linux: resident pages are the second field; one small read, no psutil needed
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_memory_bytes(device)[0]
