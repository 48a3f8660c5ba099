"""The plan beside a run: what ``nodescale plan`` estimates for the run's config against what the run measured."""

from __future__ import annotations

from typing import Any

from nodescale.errors import UserError
from nodescale.report import markdown as md
from nodescale.report.sources import RunSource


def _ratio(planned: float | None, measured: float | None) -> str:
    return f"{planned / measured:.2f}" if planned is not None and measured else md.MISSING


def plan_rows(estimate: Any, summary: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(figure, plan, measured, plan / measured) for a ``RunEstimate`` and the run's summary.json."""
    measured = summary.get("state_bytes_per_rank") or {}
    rows = []
    for label, key in (("parameters per rank (MB)", "parameter_bytes"), ("gradients per rank (MB)", "gradient_bytes"),
                       ("optimiser state per rank (MB)", "optimizer_bytes"), ("state per rank (MB)", "total_bytes")):
        planned = getattr(estimate.state, key)
        rows.append((label, md.megabytes(planned, 3), md.megabytes(measured.get(key), 3),
                     _ratio(planned, measured.get(key))))
    on_gpu = estimate.state.total_bytes + estimate.activation_bytes + estimate.gathered_bytes
    peak = summary.get("peak_memory_bytes") if summary.get("peak_memory_kind") == "cuda_max_allocated" else None
    rows.append(("state + activations + gathered (MB)", md.megabytes(on_gpu, 1),
                 md.megabytes(peak, 1) + (" (CUDA peak)" if peak else ""), _ratio(on_gpu, peak)))
    step = estimate.step.total_s if estimate.step else None
    rows.append(("step time (ms)", md.milliseconds(step), md.milliseconds(summary.get("step_seconds")),
                 _ratio(step, summary.get("step_seconds"))))
    rows.append(("throughput, all ranks (samples/s)", md.number(estimate.samples_per_s, 1),
                 md.number(summary.get("samples_per_second"), 1),
                 _ratio(estimate.samples_per_s, summary.get("samples_per_second"))))
    return rows


def plan_section(run: RunSource) -> str:
    """Markdown: the plan's figures for ``run``'s own config beside its measured ones, or why there are none."""
    from nodescale.plan.calibrate import MeasuredRun, estimate_run
    from nodescale.plan.make import DEFAULT_EFFICIENCY

    title = f"### Plan against measured: `{run.label}`"
    config = run.path / "config.yaml"
    if not config.is_file():
        return f"{title}\n\n_No config.yaml in the run directory: nothing to plan from._"
    try:
        from nodescale.config.load import load_config

        estimate = estimate_run(MeasuredRun(run.path, run.summary, load_config(config)), DEFAULT_EFFICIENCY)
    except UserError as exc:  # the dataset is gone, the model no longer builds: the report goes on without it
        return f"{title}\n\n_Not estimated: {exc.what}: {exc.rule}._"
    notes = [
        "The plan's figures for this run's config, world size and strategy (`nodescale plan`), all ranks on one "
        "node. Memory: the run's peak is comparable only on a GPU (`torch.cuda.max_memory_allocated`).",
        f"Step time: compute at {estimate.efficiency:.0%} of the device's peak (`bench/peaks.yaml`); communication "
        "is not priced (no bandwidth is known for a past run). `nodescale plan --calibrate RUN` fits the efficiency "
        "to this run." if estimate.step else "Step time: not estimated, the device is not in `bench/peaks.yaml`.",
    ]
    return "\n\n".join([title, " ".join(notes),
                        md.table(["", "plan", "measured", "plan / measured"], plan_rows(estimate, run.summary))])
