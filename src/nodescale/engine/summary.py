"""The end-of-run summary: honest throughput, timing and accuracy.

Throughput is the sum over ranks of the real samples each processed after
warm-up, divided by the slowest rank's training time (the job is as fast as
its slowest rank); never rank 0's count times the world size.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from rich.table import Table

from nodescale.config.schema import RunConfig
from nodescale.distributed.process_group import Runtime
from nodescale.strategies.base import Footprint


@dataclass(frozen=True)
class EvalResult:
    """The last evaluation: loss and accuracy over every validation sample once, and their count."""

    loss: float | None
    accuracy: float | None  # None for regression
    samples: int | None


@dataclass
class Timing:
    """What the clock saw, per rank, before the cross-rank reduction."""

    epoch_seconds: list[float] = field(default_factory=list)
    timed_seconds: float = 0.0
    timed_samples: int = 0
    timed_steps: int = 0
    includes_warmup: bool = False
    data_wait_seconds: float = 0.0


def gather_summary(
    cfg: RunConfig,
    runtime: Runtime,
    timing: Timing,
    position: dict[str, int],
    last_eval: EvalResult,
    peak_memory: tuple[int, str],
    footprint: Footprint | None,
    wall_seconds: float,
) -> dict[str, Any]:
    """Reduce every rank's figures into the run summary (a collective: call on all ranks)."""
    device = runtime.device
    # float64: sample counts must stay exact and seconds must not round.
    samples = torch.tensor(float(timing.timed_samples), dtype=torch.float64, device=device)
    # Maxima over ranks: the job is as slow as its slowest rank and as big as its biggest.
    wait_fraction = timing.data_wait_seconds / timing.timed_seconds if timing.timed_seconds else 0.0
    maxima = torch.tensor([timing.timed_seconds, float(peak_memory[0]), wait_fraction, *timing.epoch_seconds],
                          dtype=torch.float64, device=device)
    rates = torch.zeros(runtime.world_size, dtype=torch.float64, device=device)
    rates[runtime.rank] = timing.timed_samples / timing.timed_seconds if timing.timed_seconds > 0 else 0.0
    if runtime.has_process_group:
        dist.all_reduce(samples)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)  # every rank ran the same epochs
        dist.all_reduce(rates)  # each rank filled only its own slot
    state_bytes = _gather_footprints(footprint, runtime)
    total_samples = int(samples.item())
    slowest, peak, worst_wait, *epochs = maxima.tolist()
    steps = timing.timed_steps
    throughput = total_samples / slowest if slowest > 0 else None
    devices = runtime.world_size * devices_per_process(cfg, device)
    return {
        "world_size": runtime.world_size,
        "strategy": cfg.strategy.name,
        "backend": runtime.backend,
        "model": cfg.model.name,
        "dataset": cfg.data.name,
        "precision": cfg.train.precision,
        "batch_size_per_process": cfg.train.batch_size,
        "global_batch_size": cfg.train.batch_size * cfg.train.grad_accum * runtime.world_size,
        "epochs_completed": position["epoch"],
        "global_steps": position["global_step"],
        "samples_per_second": throughput,
        "devices": devices,
        "samples_per_second_per_device": throughput / devices if throughput else None,
        "samples_per_second_by_rank": [round(rate, 3) for rate in rates.tolist()],
        "timed_samples": total_samples,
        "timed_steps": steps,
        "step_seconds": slowest / steps if steps else None,
        "data_wait_fraction": worst_wait if timing.timed_seconds else None,
        "timing_warmup_steps": cfg.train.timing_warmup_steps,
        "timing_includes_warmup": timing.includes_warmup,
        "epoch_seconds": [round(s, 4) for s in epochs],
        "average_epoch_seconds": _average_epoch(epochs),
        "average_epoch_excludes_first": len(epochs) > 1,
        "val_loss": last_eval.loss,
        "val_accuracy": last_eval.accuracy,
        "val_samples": last_eval.samples,
        "peak_memory_bytes": int(peak),
        "peak_memory_kind": peak_memory[1],
        # Parameters, gradients and optimiser state each rank held (what sharding divides).
        "state_bytes_per_rank": state_bytes,
        "wall_seconds": wall_seconds,
        "device": device_name(device),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }


def _gather_footprints(footprint: Footprint | None, runtime: Runtime) -> dict[str, Any] | None:
    """Every rank's footprint: the largest rank's figures, and each rank's total."""
    kinds = ("parameter_bytes", "gradient_bytes", "optimizer_bytes")
    mine = [float(getattr(footprint, kind)) for kind in kinds] if footprint else [-1.0] * len(kinds)
    table = torch.zeros(runtime.world_size, len(kinds), dtype=torch.float64, device=runtime.device)
    table[runtime.rank] = torch.tensor(mine, dtype=torch.float64)
    if runtime.has_process_group:
        dist.all_reduce(table)  # each rank filled only its own row
    rows = table.tolist()
    if any(value < 0 for row in rows for value in row):
        return None  # not measured (no optimiser step was taken)
    largest = max(rows, key=sum)
    return {
        **{kind: int(value) for kind, value in zip(kinds, largest, strict=True)},
        "total_bytes": int(sum(largest)),
        "total_bytes_by_rank": [int(sum(row)) for row in rows],
    }


def devices_per_process(cfg: RunConfig, device: torch.device) -> int:
    # DataParallel drives every GPU of the node from one process.
    if cfg.strategy.name == "dp" and device.type == "cuda":
        return max(1, torch.cuda.device_count())
    return 1


def _average_epoch(epochs: list[float]) -> float | None:
    # The first epoch carries start-up costs (allocator, caches, compilation);
    # with a single epoch there is nothing else to report.
    if not epochs:
        return None
    rest = epochs[1:] or epochs
    return sum(rest) / len(rest)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def summary_table(summary: dict[str, Any]) -> Table:
    """The timing and stats table printed at the end of a run."""
    table = Table(title="nodescale run summary", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")

    def row(label: str, value: Any, unit: str = "") -> None:
        table.add_row(label, "n/a" if value is None else f"{value}{unit}")

    def number(value: float | None, digits: int) -> str | None:
        return None if value is None else f"{value:,.{digits}f}"

    row("processes (world size)", summary["world_size"])
    row("strategy / backend", f"{summary['strategy']} / {summary['backend'] or 'none'}")
    row("epochs completed", summary["epochs_completed"])
    row("optimiser steps", summary["global_steps"])
    if summary["average_epoch_seconds"] is None:
        row("average epoch time", "no whole epoch timed")
    else:
        label = "average epoch time" + (" (excluding the first)" if summary["average_epoch_excludes_first"]
                                        else " (the only epoch)")
        row(label, number(summary["average_epoch_seconds"], 3), " s")
    step_seconds = summary["step_seconds"]
    row("average step time", None if step_seconds is None else f"{step_seconds * 1000:,.2f}", " ms")
    row("throughput (all ranks)", number(summary["samples_per_second"], 1), " samples/s")
    row("throughput per device", number(summary["samples_per_second_per_device"], 1), " samples/s")
    if summary["timing_includes_warmup"]:
        row("note", "too few steps to exclude warm-up")
    if "tokens_per_second" in summary:  # a language model's
        row("tokens (all ranks)", number(summary["tokens_per_second"], 0), " tokens/s")
        mfu = summary["mfu"]
        row("model FLOPs utilisation", "unknown for this device" if mfu is None else f"{mfu:.2%}")
        counted, estimated = summary["training_flops_per_token"], summary["estimated_training_flops_per_token"]
        if counted is not None and estimated is not None:
            row("training FLOPs per token", f"{counted:,.4g} (6N + 12LdT: {estimated:,.4g})")
    row("validation loss", number(summary["val_loss"], 4))
    if summary.get("val_perplexity") is not None:
        row("validation perplexity", number(summary["val_perplexity"], 3))
    accuracy = summary["val_accuracy"]
    row("validation accuracy", None if accuracy is None else f"{accuracy:.2%}")
    row("peak memory", f"{summary['peak_memory_bytes'] / 1e6:,.1f}", f" MB ({summary['peak_memory_kind']})")
    state = summary["state_bytes_per_rank"]
    if state:
        row("training state, largest rank", number(state["total_bytes"] / 1e6, 3), " MB")
        parts = (state[kind] / 1e6 for kind in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"))
        row("  parameters / gradients / optimiser", " / ".join(f"{part:,.3f}" for part in parts), " MB")
    row("wall time", number(summary["wall_seconds"], 2), " s")
    return table
