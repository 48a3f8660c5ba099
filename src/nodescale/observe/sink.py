"""What every metric logger receives, and the scalars it writes.

The trainer produces one stream of records (the lines of ``metrics.jsonl``), on
global rank 0 only and already reduced across ranks. A sink turns them into
its own format: ``metrics.csv``, TensorBoard event files, an MLflow run, a W&B
run. Sinks never see tensors and never synchronise: what they cost is the
writing, at log intervals.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol

Status = Literal["finished", "failed", "stopped"]

# metrics.jsonl key -> the logged name, for the record kinds that carry scalars.
# One name per quantity, so TensorBoard, MLflow and W&B show the same charts.
SCALAR_NAMES: dict[str, dict[str, str]] = {
    "step": {
        "loss": "train/loss",
        "accuracy": "train/accuracy",
        "lr": "train/lr",
        "samples_per_second": "perf/samples_per_second",
        "step_seconds": "perf/step_seconds",
        "data_wait_seconds": "perf/data_wait_seconds",
        "compute_seconds": "perf/compute_seconds",
        "memory_bytes": "perf/memory_bytes",
        "tokens_per_second": "perf/tokens_per_second",
        "mfu": "perf/mfu",
    },
    "epoch": {
        "val_loss": "val/loss",
        "val_accuracy": "val/accuracy",
        "epoch_seconds": "perf/epoch_seconds",
        "val_perplexity": "val/perplexity",
    },
}

# summary.json key -> logged name, for what a run reports once at its end.
SUMMARY_NAMES: dict[str, str] = {
    "samples_per_second": "final/samples_per_second",
    "val_loss": "final/val_loss",
    "val_accuracy": "final/val_accuracy",
    "wall_seconds": "final/wall_seconds",
    "energy_joules": "final/energy_joules",
    "tokens_per_second": "final/tokens_per_second",
    "val_perplexity": "final/val_perplexity",
    "mfu": "final/mfu",
}


def scalars_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics record under their logged names ({} for kinds without scalars).

    None (accuracy of a regression run, say) and non-numbers are left out.
    """
    names = SCALAR_NAMES.get(str(record.get("kind")), {})
    return {name: float(record[key]) for key, name in names.items() if _is_number(record.get(key))}


def final_scalars(summary: Mapping[str, Any]) -> dict[str, float]:
    """The end-of-run figures of ``summary.json`` that loggers record once."""
    return {name: float(summary[key]) for key, name in SUMMARY_NAMES.items() if _is_number(summary.get(key))}


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """The resolved configuration as flat ``section.key`` hyper-parameters (lists joined, None as 'none')."""
    flat: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_params(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            flat[name] = ",".join(str(item) for item in value)
        elif value is None:
            flat[name] = "none"
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # NaN: not logged


class Sink(Protocol):
    """A metric logger. Built and used on global rank 0 only; every method is called from the training thread."""

    name: str

    def start(self, config: dict[str, Any], resumed: bool) -> None:
        """Open the run and record the resolved configuration (``RunConfig.model_dump(mode="json")``).

        ``resumed``: the run continues an earlier one in the same run directory (``--resume`` or a
        restart); a sink that can continue the same run (MLflow run id, W&B run id) does so.
        """

    def write(self, record: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` record (``kind`` step, epoch, checkpoint, stopped...); ``step`` is the x axis."""

    def finish(self, summary: dict[str, Any] | None, status: Status) -> None:
        """Record the end-of-run figures (``summary.json``; None when the run failed or stopped) and close."""
