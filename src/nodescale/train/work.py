"""A language model's work per sample for the run's figures: tokens, FLOPs, and the device's peak for MFU."""

from __future__ import annotations

import torch
from torch import nn

from nodescale.bench import peaks
from nodescale.engine.summary import device_name
from nodescale.engine.work import SampleWork
from nodescale.models.introspect import training_flops_per_sample, unwrap
from nodescale.models.spec import InputSpec


def language_model_work(model: nn.Module, spec: InputSpec, precision: str, device: torch.device) -> SampleWork | None:
    """Tokens and training FLOPs per sample (torch's counter, and ``6N + 12LdT`` where the model has it), and
    this device's peak from bench/peaks.yaml; None for other tasks. Call before the strategy wraps the model."""
    tokens = spec.tokens_per_sample
    if tokens is None:
        return None
    try:
        counted: int | None = training_flops_per_sample(model, spec)
    except Exception:  # noqa: BLE001 - a model the meta device cannot run (a user's): the MFU is unknown
        counted = None
    estimate = getattr(unwrap(model), "estimated_training_flops_per_token", None)
    estimated = estimate(tokens) * tokens if callable(estimate) else None
    entry = peaks.find_peak(device_name(device))
    peak = entry.flops(peaks.peak_dtype(precision, entry)) if entry is not None else None
    return SampleWork(tokens, counted, estimated, peak)


def describe(work: SampleWork) -> str:
    """The start line's cross-check of the FLOP counter against 6N + 12LdT."""
    counted = "not counted" if work.training_flops is None else f"{work.training_flops / work.tokens:.4g}"
    estimated = "" if work.estimated_flops is None else f" (6N + 12LdT: {work.estimated_flops / work.tokens:.4g})"
    return f"language model: {work.tokens} tokens per sample, training FLOPs per token {counted}{estimated}"
