"""The DeepSpeed configuration of a run: generated from nodescale's, or the user's file checked against it.

Pure functions, no DeepSpeed import: the launcher checks a file before any
process starts, and tests check the arithmetic directly.

nodescale's configuration decides the batch layout and precision; a user's
``ds_config.json`` may add anything else (ZeRO tuning, offload, communication
settings). Where the file states something nodescale also decides, the two
must agree, and the error shows both and how to reconcile them. In particular
``train_batch_size`` must equal micro-batch x accumulation x world size.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodescale.errors import UserError

if TYPE_CHECKING:
    from nodescale.config.schema import RunConfig

DEFAULT_ZERO_STAGE = 2

# A string, or a trailing comma before a closing bracket, or a // or /* */ comment.
_LENIENT = re.compile(r'"(?:\\.|[^"\\])*"|,(?=\s*[}\]])|//[^\n]*|/\*.*?\*/', re.DOTALL)


def read_user_config(path: Path) -> dict[str, Any]:
    """``path`` as JSON, accepting the trailing commas and comments that seeds' configs carry."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"--deepspeed-config {path}", f"cannot be read ({exc.strerror})",
                        "pass the path of a DeepSpeed JSON file") from None
    cleaned = _LENIENT.sub(lambda m: m.group(0) if m.group(0).startswith('"') else "", text)
    try:
        config = json.loads(cleaned)
    except json.JSONDecodeError as exc:
        raise UserError(f"--deepspeed-config {path}", f"is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                        f"{exc.msg})", "fix the file; trailing commas and comments are accepted") from None
    if not isinstance(config, dict):
        raise UserError(f"--deepspeed-config {path}", "must hold a JSON object ({...})",
                        "see https://www.deepspeed.ai/docs/config-json/")
    return config


def config_for_run(cfg: RunConfig, world_size: int, has_batchnorm: bool) -> dict[str, Any]:
    """:func:`build_config` for a nodescale run on ``world_size`` ranks, its user file read and checked."""
    path = cfg.strategy.deepspeed_config
    return build_config(
        read_user_config(path) if path else None, micro_batch=cfg.train.batch_size,
        grad_accum=cfg.train.grad_accum, world_size=world_size, precision=cfg.train.precision,
        zero_stage=cfg.strategy.zero_stage, grad_clip=cfg.optim.grad_clip, cpu_offload=cfg.strategy.cpu_offload,
        has_batchnorm=has_batchnorm,
    )


def _given(config: dict[str, Any], key: str) -> Any:
    value = config.get(key)
    return None if value == "auto" else value


def build_config(
    user: dict[str, Any] | None,
    *,
    micro_batch: int,
    grad_accum: int,
    world_size: int,
    precision: str,
    zero_stage: int | None,
    grad_clip: float | None,
    cpu_offload: str,
    has_batchnorm: bool,
    source: str = "--deepspeed-config",
) -> dict[str, Any]:
    """The complete DeepSpeed config for this run; ``UserError`` where ``user`` contradicts it."""
    config = copy.deepcopy(user or {})
    _check_batch(config, micro_batch, grad_accum, world_size, source)
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config["gradient_accumulation_steps"] = grad_accum
    config["train_batch_size"] = micro_batch * grad_accum * world_size

    zero = config.setdefault("zero_optimization", {})
    file_stage = _given(zero, "stage")
    if zero_stage is not None and file_stage is not None and file_stage != zero_stage:
        raise UserError(f"--zero-stage {zero_stage} with {source} zero_optimization.stage {file_stage}",
                        "the two disagree", f"drop one of them, or make both {zero_stage}")
    zero["stage"] = zero_stage if zero_stage is not None else (file_stage if file_stage is not None
                                                               else DEFAULT_ZERO_STAGE)
    _apply_offload(zero, cpu_offload)
    if cpu_offload != "none":
        # DeepSpeed insists on its own CPU Adam for offloaded state unless told that the
        # torch optimiser nodescale hands it is meant (it steps on the CPU either way).
        config.setdefault("zero_force_ds_cpu_optimizer", False)
    _apply_precision(config, precision, has_batchnorm, source)

    file_clip = _given(config, "gradient_clipping")
    if grad_clip is not None and file_clip not in (None, 0, 0.0) and file_clip != grad_clip:
        raise UserError(f"optim.grad_clip {grad_clip} with {source} gradient_clipping {file_clip}",
                        "the two disagree", "drop one of them")
    # DeepSpeed clips at 1.0 unless told otherwise; nodescale clips only when asked.
    config["gradient_clipping"] = grad_clip if grad_clip is not None else (file_clip or 0.0)
    # The optimiser is nodescale's (torch's AdamW, Adam or SGD), stepped by ZeRO.
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("steps_per_print", 10**9)  # nodescale logs progress itself
    for owned in ("optimizer", "scheduler"):
        if owned in config:
            raise UserError(f"{source} section {owned!r}", "nodescale builds the optimiser and learning-rate "
                            "schedule itself (--optimizer, --lr, optim.schedule)",
                            f"remove the {owned!r} section and set them with nodescale's options")
    return config


def _check_batch(config: dict[str, Any], micro: int, accum: int, world: int, source: str) -> None:
    file_micro = _given(config, "train_micro_batch_size_per_gpu")
    if file_micro is not None and file_micro != micro:
        raise UserError(f"{source} train_micro_batch_size_per_gpu {file_micro}",
                        f"nodescale's batch size per process is {micro} (--batch-size)",
                        f"pass --batch-size {file_micro}, or set it to \"auto\" or remove it in the file")
    file_accum = _given(config, "gradient_accumulation_steps")
    if file_accum is not None and file_accum != accum:
        raise UserError(f"{source} gradient_accumulation_steps {file_accum}",
                        f"nodescale accumulates {accum} micro-batches (--grad-accum)",
                        f"pass --grad-accum {file_accum}, or set it to \"auto\" or remove it in the file")
    file_total = _given(config, "train_batch_size")
    total = micro * accum * world
    if file_total is not None and file_total != total:
        raise UserError(
            f"{source} train_batch_size {file_total}",
            f"must equal micro-batch x accumulation x world size = {micro} x {accum} x {world} = {total}",
            f"set train_batch_size to {total} or \"auto\", or change --batch-size/--grad-accum/the number of "
            "processes so the product is the batch you meant",
        )


def _apply_offload(zero: dict[str, Any], cpu_offload: str) -> None:
    if cpu_offload != "none" and zero["stage"] == 0:
        raise UserError(f"--cpu-offload {cpu_offload} with ZeRO stage 0", "DeepSpeed offloads from stage 1 on",
                        "use --zero-stage 1, 2 or 3, or drop --cpu-offload")
    if cpu_offload in ("optimizer", "all"):
        zero.setdefault("offload_optimizer", {"device": "cpu", "pin_memory": True})
    if cpu_offload == "all":
        if zero["stage"] != 3:
            raise UserError(f"--cpu-offload all with ZeRO stage {zero['stage']}",
                            "DeepSpeed offloads parameters only at stage 3",
                            "use --zero-stage 3, or --cpu-offload optimizer")
        zero.setdefault("offload_param", {"device": "cpu", "pin_memory": True})


def _apply_precision(config: dict[str, Any], precision: str, has_batchnorm: bool, source: str) -> None:
    for section in ("bf16", "fp16"):
        enabled = config.get(section, {}).get("enabled", False)
        if enabled not in (False, "auto") and section != precision:
            raise UserError(f"{source} enables {section}", f"the run's precision is {precision} (--precision)",
                            f"pass --precision {section}, or set {section}.enabled to false in the file")
        config.setdefault(section, {})["enabled"] = False
    if precision == "fp32":
        return
    if has_batchnorm:
        # DeepSpeed casts parameters but not BatchNorm's fp32 running statistics, which
        # batch_norm then refuses: such models keep fp32 weights under DeepSpeed's autocast.
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16" if precision == "bf16" else "float16"}
        return
    config[precision]["enabled"] = True
