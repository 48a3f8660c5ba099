"""What one node offers a plan: GPU memory, peak FLOP/s, bus bandwidth, and where each figure came from.

Figures come from the cluster preset (``gpu_model``, ``gpu_memory_gb``, ``interconnect_gbps``), the
peak table (``bench/peaks.yaml``) and a ``bench comm`` results file; flags override them. A figure
that is nowhere is asked for, never guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodescale.errors import UserError

if TYPE_CHECKING:
    from nodescale.launch.spec import Preset

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One GPU's memory and peak, the bus bandwidth between ranks, and their sources."""

    gpu: str
    memory_bytes: int
    peak_flops: float  # per GPU, dense, for the run's precision
    peak_dtype: str
    bus_gbps: dict[str, float]  # collective -> bus bandwidth in GB/s; "any": one figure for all
    sources: dict[str, str]

    def bandwidth(self, op: str) -> float | None:
        """GB/s for ``op`` (all_reduce, all_gather, reduce_scatter); None where nothing says."""
        return self.bus_gbps.get(op) or self.bus_gbps.get("all_reduce") or self.bus_gbps.get("any")


def resolve_hardware(preset: Preset | None, precision: str, tf32: bool | None, gpu_memory_gb: float | None,
                     peak_tflops: float | None, comm: Path | None) -> Hardware:
    """The hardware of ``preset`` (None: no cluster), with ``--gpu-memory``, ``--peak-tflops`` and ``--comm``."""
    from nodescale.bench.peaks import find_peak

    model = preset.gpu_model if preset else None
    where = f"preset {preset.name!r}" if preset else "no --cluster"
    memory_gb = gpu_memory_gb or (preset.gpu_memory_gb if preset else None)
    entry = find_peak(model)
    dtype = "fp32" if precision == "fp32" and not tf32 else ("tf32" if precision == "fp32" else precision)
    peak = peak_tflops * 1e12 if peak_tflops else (entry.flops(dtype) if entry else None)
    if memory_gb is None or peak is None:
        unknown = [what for what, value in (("memory", memory_gb), (f"{dtype} peak", peak)) if value is None]
        asked = (("--gpu-memory GB", memory_gb), ("--peak-tflops TFLOPS", peak))
        flags = [flag for flag, value in asked if value is None]
        raise UserError(f"the GPU of {where}" + (f" ({model})" if model else ""),
                        f"its {' and '.join(unknown)} {'are' if len(unknown) > 1 else 'is'} not known to nodescale",
                        f"give {' and '.join(flags)} from the GPU's datasheet, e.g. --gpu-memory 40 --peak-tflops 312")
    sources = {
        "memory": "--gpu-memory" if gpu_memory_gb else f"{where}: gpu_memory_gb",
        "peak": "--peak-tflops" if peak_tflops else f"bench/peaks.yaml: {entry.source}" if entry else "",
    }
    if comm is not None:
        bus = read_comm_results(comm)
        sources["bandwidth"] = f"--comm {comm}"
    elif preset and preset.interconnect_gbps:
        bus = {"any": float(preset.interconnect_gbps)}
        sources["bandwidth"] = f"{where}: interconnect_gbps (network per node; one node's GPU links are faster)"
    else:
        bus = {}
        sources["bandwidth"] = "unknown: communication not priced (measure it: nodescale bench comm, then --comm)"
    name = model or "GPU"
    return Hardware(name, int(memory_gb * GB), float(peak), "given" if peak_tflops else dtype, bus, sources)


def read_comm_results(path: Path) -> dict[str, float]:
    """Bus bandwidth per collective from ``bench comm``'s results.json: each op's largest message."""
    what = f"--comm {str(path)!r}"
    try:
        rows: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(what, f"cannot be read as JSON ({type(exc).__name__})",
                        "give the results.json that `nodescale bench comm` wrote") from None
    best: dict[str, tuple[int, float]] = {}
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict):
            continue
        op, size, busbw = row.get("op"), row.get("bytes"), row.get("busbw_GBps")
        if isinstance(op, str) and isinstance(size, int) and isinstance(busbw, (int, float)) and busbw > 0:
            if op not in best or size > best[op][0]:
                best[op] = (size, float(busbw))
    if not best:
        raise UserError(what, "holds no rows with an op, bytes and busbw_GBps",
                        "give the results.json that `nodescale bench comm` wrote")
    return {op: busbw for op, (_, busbw) in best.items()}
