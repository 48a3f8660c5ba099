"""A plan as a table for people (``rich``) and as JSON for scripts (``--json``): the same figures."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.table import Table

from nodescale.plan.estimate import PlanRow, format_walltime
from nodescale.plan.make import Plan

GB = 1e9


def gigabytes(value: float) -> str:
    return f"{value / GB:.2f}" if value < 10 * GB else f"{value / GB:.1f}"


def duration(seconds: float) -> str:
    """Seconds read at a glance: 850 ms, 12.5 s, 3.2 h, 4.1 d."""
    for limit, unit, scale, digits in ((1, "ms", 1e-3, 0), (120, "s", 1, 1), (7200, "min", 60, 1),
                                       (172800, "h", 3600, 1)):
        if seconds < limit:
            return f"{seconds / scale:.{digits}f} {unit}"
    return f"{seconds / 86400:.1f} d"


def memory_verdict(row: PlanRow) -> str:
    if row.fits:
        return "fits"
    return f"needs {gigabytes(row.total_bytes - row.usable_bytes)} GB more"


def plan_table(plan: Plan) -> Table:
    """One line per strategy option; the recommended one marked."""
    layout = plan.layout
    title = (f"{plan.model} on {layout.nodes} node{'s' if layout.nodes > 1 else ''} x {layout.ranks_per_node} "
             f"{plan.hardware.gpu} ({layout.world_size} ranks)")
    table = Table(title=title, title_justify="left", caption="GB = 1e9 bytes, per rank; time: compute + "
                  "communication, not overlapped; --time adds start-up, checkpoints and 10%", caption_justify="left")
    for header in ("strategy", "params\nGB", "grads\nGB", "optim\nGB", "activ.\nGB", "total\nGB", "memory",
                   "step", "samples/s", "training", "--time"):
        table.add_column(header, justify="left" if header in ("strategy", "memory") else "right")
    for row in plan.rows:
        mark = " *" if row is plan.recommended else ""
        comm = "" if row.step.comm_s is not None else "+?"
        table.add_row(
            row.option.name + mark, gigabytes(row.state.parameter_bytes), gigabytes(row.state.gradient_bytes),
            gigabytes(row.state.optimizer_bytes), gigabytes(row.activation_bytes), gigabytes(row.total_bytes),
            memory_verdict(row), duration(row.step.total_s) + comm, f"{row.samples_per_s:,.0f}",
            duration(row.train_s), format_walltime(row.ask_s),
        )
    return table


def summary_lines(plan: Plan) -> list[str]:
    """What the table rests on, and the recommendation with the flags that choose it."""
    facts, hw = plan.facts, plan.hardware
    lines = [
        f"model: {facts.parameter_count:,} parameters, {facts.training_flops_per_sample / 1e9:,.2f} GFLOP per "
        f"sample (forward + backward), batch {facts.batch_size} per rank",
        f"GPU: {gigabytes(hw.memory_bytes)} GB ({hw.sources['memory']}); peak {hw.peak_flops / 1e12:,.1f} TFLOP/s "
        f"{hw.peak_dtype} at {plan.workload.efficiency:.0%} efficiency ({hw.sources['peak']})",
        f"bandwidth: {', '.join(f'{op} {gbps:g} GB/s' for op, gbps in hw.bus_gbps.items()) or 'none'} "
        f"({hw.sources['bandwidth']})",
    ]
    if (fit := plan.calibration) is not None:
        ranks = f"{fit.world_size} rank{'s' if fit.world_size > 1 else ''}"
        lines.append(f"efficiency {fit.efficiency:.1%} fitted to {fit.run}: its step {fit.measured_step_s * 1e3:,.1f} "
                     f"ms on {ranks}, of which the plan prices {fit.comm_s * 1e3:,.1f} ms as communication and copies")
    lines += [f"note: {note}" for note in plan.notes]
    best = plan.recommended
    if best is None:
        least = min(plan.rows, key=lambda row: row.total_bytes - row.usable_bytes)
        lines.append(f"nothing fits: the closest, {least.option.name}, {memory_verdict(least)}; try a smaller "
                     "--batch-size, more nodes for the sharded options, or GPUs with more memory")
    else:
        flags = " ".join(best.option.train_flags())
        lines.append(f"recommended (*): {best.option.name}, the fastest that fits: {flags}; "
                     f"ask for --nodes {plan.layout.nodes} --time {format_walltime(best.ask_s)}")
    return lines


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan for ``--json``: the table's figures unrounded, bytes and seconds."""
    facts, hw = plan.facts, plan.hardware
    return {
        "model": {"name": plan.model, "parameters": facts.parameter_count,
                  "forward_flops_per_sample": facts.forward_flops_per_sample, "batch_size": facts.batch_size,
                  "activation_bytes": facts.activation_bytes,
                  "checkpointed_activation_bytes": facts.checkpointed_activation_bytes},
        "hardware": {"gpu": hw.gpu, "memory_bytes": hw.memory_bytes, "peak_flops": hw.peak_flops,
                     "peak_dtype": hw.peak_dtype, "bus_gbps": hw.bus_gbps, "sources": hw.sources},
        "layout": {"nodes": plan.layout.nodes, "ranks_per_node": plan.layout.ranks_per_node,
                   "world_size": plan.layout.world_size},
        "workload": {"train_samples": plan.workload.train_samples, "epochs": plan.workload.epochs,
                     "max_steps": plan.workload.max_steps, "grad_accum": plan.workload.grad_accum,
                     "precision": plan.workload.precision, "efficiency": plan.workload.efficiency},
        "rows": [_row_json(row) for row in plan.rows],
        "recommended": plan.recommended.option.name if plan.recommended else None,
        "notes": plan.notes,
        "calibration": asdict(plan.calibration) if plan.calibration else None,
    }


def _row_json(row: PlanRow) -> dict[str, Any]:
    return {
        "strategy": row.option.name, "train_flags": row.option.train_flags(), **row.state.as_dict(),
        "activation_bytes": row.activation_bytes, "gathered_bytes": row.gathered_bytes,
        "rank_bytes": row.total_bytes, "usable_bytes": row.usable_bytes, "fits": row.fits,
        "step": row.step.as_dict(), "steps": row.steps, "global_batch": row.global_batch,
        "samples_per_second": row.samples_per_s, "train_seconds": row.train_s, "checkpoint_seconds": row.checkpoint_s,
        "time": format_walltime(row.ask_s), "time_seconds": row.ask_s,
    }
