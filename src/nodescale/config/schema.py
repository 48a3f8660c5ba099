"""The one typed configuration tree of a nodescale run.

Every field has a default and a one-line description that doubles as CLI help.
Sources are merged as defaults < YAML file (``--config``) < CLI flags and the
result is validated here, before any process starts: unknown keys, wrong types
and impossible combinations are rejected.

This module must not import torch: validation runs in the launcher process,
and ``nodescale config show`` should answer instantly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from nodescale.config.combinations import check_combinations
from nodescale.config.strategy import DDPSection, StrategySection
from nodescale.data.registry import DATASETS
from nodescale.data.section import DataSection
from nodescale.errors import UserError, unknown_choice
from nodescale.models.section import ModelSection
from nodescale.section import MAX_SECONDS, Section, known_or_plugin
from nodescale.stop_signals import DEFAULT as DEFAULT_STOP_SIGNALS

LOSSES = ("auto", "cross_entropy", "mse")


class OptimSection(Section):
    name: Literal["adamw", "adam", "sgd"] = Field("adamw", description="optimiser")
    lr: float = Field(3e-3, gt=0.0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="decoupled weight decay (adamw) or L2 (sgd, adam)")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum")
    schedule: Literal["constant", "cosine"] = Field("cosine", description="learning-rate schedule over the run")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up, in optimiser steps")
    grad_clip: float | None = Field(None, gt=0.0, description="clip the global gradient norm to this value")


class TrainSection(Section):
    epochs: int = Field(10, ge=1, description="passes over the training set (pydoc's default: 3)")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimiser steps")
    batch_size: int = Field(32, ge=1, description="samples per process per micro-batch")
    grad_accum: int = Field(1, ge=1, description="micro-batches accumulated per optimiser step")
    seed: int = Field(0, ge=0, le=2**64 - 1, description="seed of weights, data order and splits (same on every "
                      "rank; torch takes 0 to 2**64-1)")
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="autocast precision")
    compile: bool = Field(False, description="torch.compile the model")
    channels_last: bool = Field(False, description="channels_last memory format for image models")
    cudnn_benchmark: bool = Field(
        True, description="let cuDNN time its convolution algorithms for the (fixed) batch shapes and keep the "
        "fastest (CUDA only)"
    )
    tf32: bool | None = Field(
        None, description="TF32 tensor cores for float32 matmuls and convolutions (CUDA only): true for both, "
        "false for neither (strict fp32), null: torch's defaults (convolutions only)"
    )
    log_every: int = Field(10, ge=1, description="optimiser steps between metric reductions and log lines")
    timing_warmup_steps: int = Field(
        5, ge=0, description="optimiser steps excluded from throughput and step-time figures"
    )
    progress: bool = Field(True, description="show a progress bar on rank 0")
    loss: str = Field(
        "auto", description="per-sample loss: auto (cross_entropy for classification and language modelling, mse "
        "for regression), cross_entropy, mse, or your function (output, target) -> losses of shape (batch,), "
        "FILE.py:FUNCTION"
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each repeated block's activations in backward instead of keeping them"
    )
    stop_signals: str = Field(
        DEFAULT_STOP_SIGNALS, description="signals that make every rank stop at a step boundary soon after "
        "(within about 0.4 s, or two longer steps), save a checkpoint and exit for requeue (comma-separated; "
        "'none': keep the signals' default actions)"
    )
    heartbeat_timeout_s: float = Field(
        300.0, ge=0, le=MAX_SECONDS, description="fail the job when a rank makes no progress for this many seconds, "
        "naming it (0: no heartbeat watchdog)"
    )

    @field_validator("heartbeat_timeout_s")
    @classmethod
    def _off_or_a_second(cls, value: float) -> float:
        # The watchdog's store client must connect within it, and it beats every fifth of it (at most each 0.2 s).
        if 0 < value < 1:
            raise ValueError("must be 0 (no watchdog) or at least 1 second")
        return value

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        return known_or_plugin("loss", value, LOSSES)

    @field_validator("stop_signals")
    @classmethod
    def _known_signals(cls, value: str) -> str:
        from nodescale.stop_signals import normalise_signal_names

        return normalise_signal_names(value)


class CheckpointSection(Section):
    every: int = Field(0, ge=0, description="save every this many optimiser steps (0: only at the end)")
    keep_last: int = Field(2, ge=1, description="checkpoints kept; older ones are deleted")
    at_end: bool = Field(True, description="save a checkpoint when training ends")
    resume: bool = Field(False, description="continue from the newest checkpoint in the run directory")
    max_restarts: int = Field(
        0, ge=0, description="number of times every rank is restarted from the newest whole checkpoint after a "
        "worker process fails (killed, out of memory, an error on one rank); user errors are not retried; "
        "nodescale's own launcher only (under torchrun: torchrun --max-restarts)"
    )
    format: Literal["auto", "full", "sharded"] = Field(
        "auto", description="full: one file gathered on rank 0; sharded: every rank writes its shard into a "
        "directory; auto: sharded for fsdp and deepspeed, full otherwise"
    )
    async_save: bool = Field(
        False, description="write checkpoints in the background: training goes on once the state is copied to "
        "host memory; one save at a time, the manifest only when every file is on disk"
    )
    stage: Path | None = Field(
        None, description="save checkpoints to this node-local directory first, then copy them to the run "
        "directory in the background (the manifest there once the copy is on disk; the job's end waits for it)"
    )


# Metric loggers: the module each needs and the optional extra that installs it.
# metrics.jsonl and metrics.csv are always written; these come on top.
LOGGERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}
ALWAYS_LOGGED = ("csv", "jsonl")


class ObserveSection(Section):
    log: list[str] = Field(
        default_factory=list, description="metric loggers besides metrics.jsonl and metrics.csv (always written): "
        "any of tensorboard, mlflow, wandb, comma-separated"
    )
    mlflow_uri: str | None = Field(
        None, description="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else a file store in RUN/mlruns)"
    )
    experiment: str = Field("nodescale", min_length=1, description="MLflow experiment and W&B project name")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="W&B mode: offline writes RUN/wandb for `wandb sync`; online needs a login"
    )
    monitor: bool = Field(
        False, description="sample CPU, memory and GPU utilisation, memory, temperature and power on one process "
        "per node into RUN/monitor/node-N.csv"
    )
    monitor_interval_s: float = Field(5.0, ge=0.1, le=MAX_SECONDS, description="seconds between monitor samples")
    profile: str | None = Field(
        None, description="START:COUNT: profile optimiser steps START..START+COUNT-1 with the PyTorch profiler; "
        "a trace per rank and an operator table in RUN/profile"
    )

    @field_validator("log", mode="before")
    @classmethod
    def _known_loggers(cls, value: object) -> list[str]:
        if isinstance(value, str):
            value = [part for part in value.split(",")]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"log {value!r}", "must be a comma-separated list of logger names",
                            "use --log tensorboard,mlflow")
        names: list[str] = []
        for raw in value:
            name = str(raw).strip().lower()
            if not name or name in ALWAYS_LOGGED:
                continue  # always on: naming them is harmless
            if name not in LOGGERS:
                raise unknown_choice("logger", name, [*LOGGERS, *ALWAYS_LOGGED])
            if name not in names:
                names.append(name)
        return names

    @field_validator("log")
    @classmethod
    def _installed(cls, names: list[str]) -> list[str]:
        from importlib.util import find_spec

        for name in names:
            module, extra = LOGGERS[name]
            if find_spec(module) is None:
                raise UserError(f"--log {name}", f"needs the {module!r} package, which is not installed",
                                f"pip install 'nodescale[{extra}]' (or pip install {module})")
        return names

    @field_validator("profile")
    @classmethod
    def _window(cls, value: str | None) -> str | None:
        if value is None:
            return None
        start, count = profile_window(value)
        return f"{start}:{count}"


def profile_window(text: str) -> tuple[int, int]:
    """``START:COUNT`` -> (first profiled optimiser step, counted from 1; number of steps)."""
    parts = str(text).strip().split(":")
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts) or min(int(p) for p in parts) < 1:
        raise UserError(f"profile {text!r}", "must be START:COUNT, two whole numbers of at least 1",
                        "use --profile 10:5 to profile optimiser steps 10 to 14")
    return int(parts[0]), int(parts[1])


class RunConfig(Section):
    """The whole configuration of one run."""

    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    train: TrainSection = Field(default_factory=TrainSection)
    strategy: StrategySection = Field(default_factory=DDPSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    observe: ObserveSection = Field(default_factory=ObserveSection)
    out: Path | None = Field(None, description="run directory; default runs/<model>-<dataset>-<time>")

    @field_validator("out", mode="before")
    @classmethod
    def _out_names_a_directory(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():  # Path("") is ".": the current directory, unasked
            raise UserError(f"--out {value!r}", "names no directory",
                            "give one, e.g. --out runs/mine (--out . means the current directory)")
        return value

    @model_validator(mode="before")
    @classmethod
    def _dataset_epochs(cls, values: Any) -> Any:
        """A dataset's own default number of epochs, where the user set none."""
        if not isinstance(values, dict):
            return values
        data, train = values.get("data") or {}, values.get("train") or {}
        if not isinstance(data, dict) or not isinstance(train, dict) or "epochs" in train:
            return values
        entry = DATASETS.get(str(data.get("name", DataSection.model_fields["name"].default)))
        if entry is None or entry.epochs is None:
            return values
        return {**values, "train": {**train, "epochs": entry.epochs}}

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        check_combinations(self)
        return self
