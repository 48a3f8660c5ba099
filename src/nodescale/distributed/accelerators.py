"""How many GPUs this process can use, asked of torch only where a GPU driver is installed.

The launcher needs the count for ``--nproc auto`` before any worker starts. Importing torch
for it costs 1.5 s or more (far more on a parallel filesystem) and puts that time in front of
every worker's start; on a machine without an NVIDIA or AMD kernel driver the answer is 0
without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from nodescale.errors import UserError

# What the NVIDIA and AMD (ROCm) kernel drivers create on Linux.
DRIVER_PATHS = (Path("/proc/driver/nvidia"), Path("/dev/kfd"))


def gpu_driver_present(paths: tuple[Path, ...] = DRIVER_PATHS) -> bool:
    """True unless this is Linux and neither GPU driver is loaded (elsewhere: unknown, so True)."""
    if not sys.platform.startswith("linux"):
        return True
    return any(path.exists() for path in paths)


def visible_gpus() -> int:
    """The CUDA/ROCm devices torch would see here (0 without a driver, without importing torch)."""
    if not gpu_driver_present():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_local_processes() -> int:
    """``--nproc auto``: one process per GPU, or 2 on a machine without GPUs."""
    return visible_gpus() or 2


def check_backend(backend: str, what: str, hint: str, device_type: str | None = None) -> None:
    """A ``UserError`` when ``backend`` cannot run here: nccl without a CUDA device (on this machine,
    or for a rank placed on ``device_type``). ``what`` names the setting (``--backend``), ``hint`` its fix.

    Checked before processes start: each rank would otherwise fail inside torch, with a traceback.
    """
    if backend != "nccl":
        return  # gloo runs wherever torch.distributed does; auto picks what the device runs
    problem = None
    if device_type is None and not gpu_driver_present():
        problem = "no NVIDIA or AMD GPU driver is loaded on this machine"
    else:
        import torch
        import torch.distributed as dist

        if not dist.is_nccl_available():
            problem = f"this torch ({torch.__version__}) is built without NCCL"
        elif device_type is None and not torch.cuda.is_available():
            problem = "torch sees no CUDA device here"
        elif device_type not in (None, "cuda"):
            problem = f"this rank runs on the {device_type}"
    if problem is not None:
        raise UserError(f"{what} nccl", f"NCCL needs a CUDA device, and {problem}", hint)
