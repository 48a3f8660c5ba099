"""The one rule every ``--cpu-offload`` path shares: there must be an accelerator to offload from."""

from __future__ import annotations

from nodescale.errors import UserError


def refuse_offload_without_accelerator(cpu_offload: str, has_accelerator: bool) -> None:
    """``UserError`` for any offload when training state already lives in host memory.

    Called by the launcher before any process starts, and by the FSDP and DeepSpeed
    strategies in each rank (under torchrun, srun or mpiexec there is no launcher check).
    """
    if cpu_offload != "none" and not has_accelerator:
        raise UserError(f"--cpu-offload {cpu_offload} on a machine without GPUs",
                        "offloading moves training state from an accelerator to host memory; without one, "
                        "everything is in host memory already", "drop --cpu-offload, or run on GPU nodes")
