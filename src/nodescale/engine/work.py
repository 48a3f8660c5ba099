"""What one training sample of a language model holds and costs, and the figures that makes of a sample rate.

``nodescale train`` sets it on the run's record for language models; the step records
(``metrics.jsonl``/``csv``, the progress line) and ``summary.json`` both turn their
samples/s into tokens/s and model FLOPs utilisation (MFU) through :meth:`SampleWork.figures`,
so the two never disagree. Samples/s already count every rank's real samples over the
slowest rank's time; tokens/s is that times the window's length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SampleWork:
    """Tokens and FLOPs of one training sample, and the device's peak (None: unknown)."""

    tokens: int  # next-token predictions per sample: the window's length (seq_len)
    training_flops: int | None  # forward + backward, 3 x torch's FLOP counter over one forward
    estimated_flops: int | None  # the same by 6N + 12 L d T per token (PaLM), the counter's cross-check
    peak_flops: float | None  # per device, from bench/peaks.yaml for this device and precision

    def figures(self, samples_per_second: float | None, devices: int) -> dict[str, float | None]:
        """Tokens/s and MFU (achieved FLOP/s over the peak of all ``devices``) of a sample rate."""
        if samples_per_second is None:
            return {"tokens_per_second": None, "mfu": None}
        known = self.training_flops is not None and self.peak_flops and devices > 0
        mfu = samples_per_second * self.training_flops / (self.peak_flops * devices) if known else None
        return {"tokens_per_second": samples_per_second * self.tokens, "mfu": mfu}

    def summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The language-model keys of ``summary.json``, from the keys it already has."""
        per_device = self.figures(summary.get("samples_per_second_per_device"), 1)["tokens_per_second"]
        loss = summary.get("val_loss")
        return {
            "seq_len": self.tokens,
            **self.figures(summary.get("samples_per_second"), summary["devices"]),
            "tokens_per_second_per_device": per_device,
            "val_perplexity": perplexity(loss),
            "training_flops_per_token": _per_token(self.training_flops, self.tokens),
            "estimated_training_flops_per_token": _per_token(self.estimated_flops, self.tokens),
        }


def perplexity(loss: float | None) -> float | None:
    """``exp(loss)`` of a mean cross-entropy in nats (None for None; a diverged loss stops short of overflow)."""
    return None if loss is None else math.exp(min(loss, 700.0))


def _per_token(flops: int | None, tokens: int) -> float | None:
    return None if flops is None else flops / tokens
