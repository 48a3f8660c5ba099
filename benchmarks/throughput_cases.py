"""What ``throughput.py`` measures: its cases and variants, the points of its plan, each side's command.

Two kinds of case. **Images** (ResNet-50, ViT-B/16): synthetic images, ``raw_throughput.py``
against ``nodescale train --dataset synthetic``. **Language model** (GPT-2 small): random
GPT-2 token ids in nanoGPT's ``train.bin``/``val.bin`` layout, written by the harness itself
(nothing to download), ``raw_lm.py`` against ``nodescale train --dataset tokens``, both
with TF32 on (nanoGPT's setting) and, in bf16, flash attention through SDPA.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from harness import HERE

RAW_IMAGES = HERE / "raw_throughput.py"
RAW_LM = HERE / "raw_lm.py"
UNBOUNDED_EPOCHS = 1_000_000
VIT_PATCH = 16
GPT2_VOCAB = 50257  # nodescale's default vocabulary for uint16 token files
RESIDENT_TOKEN_BYTES = 4  # nodescale holds token files on the GPU as int32


@dataclass(frozen=True)
class Case:
    """One model, measured in each variant."""

    name: str  # nodescale's model name (and the raw script's --model)
    batch_size: int  # default for an 80 GB GPU
    cnn: bool  # channels_last applies
    description: str
    auto_variants: tuple[str, ...]
    language_model: bool = False  # token windows and tokens/s instead of images

    @property
    def unit(self) -> str:
        return "tokens" if self.language_model else "images"


CASES: dict[str, Case] = {
    "resnet50": Case("resnet50", 256, True, "ResNet-50 v1.5 (torchvision's layout, ImageNet stem)",
                     ("bf16+cl", "bf16+cl+compile")),
    "vit_b16": Case("vit_b16", 128, False, "ViT-B/16 (768 wide, 12 blocks, SDPA attention)",
                    ("bf16", "bf16+compile")),
    # Batch 32 x 1024 tokens: 6.6 GB of fp32 logits (and as much for their gradient), well inside 80 GB.
    "gpt2_small": Case("gpt2_small", 32, False, "GPT-2 small (124M, 12 x 768, tied embeddings, SDPA attention), "
                       "random GPT-2 token ids", ("bf16", "bf16+compile"), language_model=True),
}
QUICK_VARIANTS = {"resnet50": ("bf16+cl",), "vit_b16": ("bf16",), "gpt2_small": ("bf16+compile",)}


@dataclass(frozen=True)
class Variant:
    name: str
    precision: str  # fp32 or bf16
    channels_last: bool
    compile: bool


def parse_variant(text: str) -> Variant:
    """``bf16+cl+compile`` -> Variant; the precision first, then any of ``cl`` and ``compile``."""
    tokens = [t.strip().lower() for t in text.split("+") if t.strip()]
    if not tokens or tokens[0] not in ("fp32", "bf16"):
        raise ValueError(f"variant {text!r}: start with the precision, fp32 or bf16 (e.g. bf16+cl+compile)")
    extras = tokens[1:]
    if any(t not in ("cl", "compile") for t in extras) or len(set(extras)) != len(extras):
        raise ValueError(f"variant {text!r}: after the precision only 'cl' and 'compile', each once")
    cl, compiled = "cl" in extras, "compile" in extras
    return Variant(tokens[0] + "+cl" * cl + "+compile" * compiled, tokens[0], cl, compiled)


@dataclass(frozen=True)
class Point:
    """One case in one variant: what both sides run, identically."""

    case: str
    variant: Variant
    batch_size: int
    image_size: int  # images only
    num_classes: int  # images: classes; language model: the vocabulary
    steps: int  # optimiser steps in total, warm-up included
    warmup_steps: int
    samples: int  # nodescale's data.samples (raw: --raw-pool-batches batches); a language model: windows
    seq_len: int | None = None  # language model: tokens per window

    @property
    def key(self) -> str:
        return f"{self.case} {self.variant.name}"

    @property
    def slug(self) -> str:  # file names: no '+' or spaces
        return f"{self.case}-{self.variant.name.replace('+', '_')}"

    @property
    def per_sample(self) -> int:
        """Images or tokens in one sample (a window's predictions)."""
        return self.seq_len or 1


def data_bytes(point: Point) -> int:
    """What nodescale holds of the data: float32 images and int64 labels, or the token files as int32,
    training and validation sets."""
    if point.seq_len is not None:
        return (token_count(point.samples, point.seq_len) + token_count(point.batch_size, point.seq_len)) * \
            RESIDENT_TOKEN_BYTES
    return (point.samples + max(1, point.samples // 8)) * (3 * point.image_size**2 * 4 + 8)


def token_count(windows: int, seq_len: int) -> int:
    return windows * seq_len + 1


def write_token_files(directory: Path, point: Point, seed: int = 0) -> Path:
    """``train.bin`` of ``point.samples`` windows and ``val.bin`` of one batch of windows: uniform random uint16
    ids below the vocabulary. Random ids cost the model the same FLOPs as text; the loss stays near ln(vocab)."""
    assert point.seq_len is not None
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, windows in (("train.bin", point.samples), ("val.bin", point.batch_size)):
        ids = rng.integers(0, point.num_classes, token_count(windows, point.seq_len), dtype=np.uint16)
        ids.tofile(directory / name)
    return directory


# Rough H100 figures, only to plan the time budget; replaced by what each run actually took.
GUESS_RATE = {("resnet50", "fp32"): 1000.0, ("resnet50", "bf16"): 2300.0,
              ("vit_b16", "fp32"): 350.0, ("vit_b16", "bf16"): 900.0,
              ("gpt2_small", "fp32"): 60000.0, ("gpt2_small", "bf16"): 250000.0}  # images/s or tokens/s
GUESS_START_SECONDS = {"raw": 12.0, "nodescale": 15.0}
GUESS_COMPILE_SECONDS = {"raw": 60.0, "nodescale": 90.0}  # nodescale also compiles eval mode for validation


def guess_seconds(point: Point, side: str) -> float:
    rate = GUESS_RATE.get((point.case, point.variant.precision), 500.0)
    if point.seq_len is None:
        rate *= (224 / point.image_size) ** 2 * (1.15 if point.variant.channels_last else 1.0)
    seconds = GUESS_START_SECONDS[side] + point.steps * point.batch_size * point.per_sample / rate
    if side == "nodescale" and point.seq_len is None:  # its data drawn on the host, and a validation pass per epoch
        seconds += point.samples * 3 * point.image_size**2 * 4 / 0.3e9 + 0.05 * point.steps
    return seconds + (GUESS_COMPILE_SECONDS[side] if point.variant.compile else 0.0)


def command(side: str, point: Point, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """``side``'s command for ``point``: the raw script, or ``nodescale train --strategy single``.
    ``args`` holds the run's settings (``token_dirs``: each language model's files)."""
    v, lm = point.variant, point.seq_len is not None
    shared = ["--batch-size", str(point.batch_size), "--precision", v.precision,
              *(["--channels-last"] if v.channels_last else []), *(["--compile"] if v.compile else []),
              *(["--tf32", "--seq-len", str(point.seq_len)] if lm else [])]
    if side == "raw" and lm:
        return [sys.executable, str(RAW_LM), "--model", point.case, "--data-dir", str(args.token_dirs[point.case]),
                "--vocab-size", str(point.num_classes), *shared, "--steps", str(point.steps),
                "--warmup-steps", str(point.warmup_steps), "--device", args.device]
    if side == "raw":
        return [sys.executable, str(RAW_IMAGES), "--model", point.case, "--model-source", args.raw_source,
                "--image-size", str(point.image_size), "--num-classes", str(point.num_classes), *shared,
                "--steps", str(point.steps), "--warmup-steps", str(point.warmup_steps),
                "--pool-batches", str(args.raw_pool_batches), "--device", args.device,
                *([] if args.raw_cudnn_benchmark else ["--no-cudnn-benchmark"])]
    data = (["--dataset", "tokens", "--data-dir", str(args.token_dirs[point.case]),
             "--set", f"data.vocab_size={point.num_classes}"]
            if lm else
            ["--dataset", "synthetic", "--set", f"data.image_size={point.image_size}",
             "--set", f"data.samples={point.samples}", "--set", f"data.num_classes={point.num_classes}",
             # What torchvision builds at every image size: the ImageNet stem (auto picks the CIFAR
             # stem up to 64 px) and 16-pixel patches (auto shrinks them for small images).
             "--set", "model.stem=imagenet" if CASES[point.case].cnn else f"model.patch_size={VIT_PATCH}"])
    return [sys.executable, "-m", "nodescale", "train", "--strategy", "single", "--model", point.case, *data, *shared,
            # nodescale stops at whichever comes first, epochs or max-steps: the epochs must never bind.
            "--max-steps", str(point.steps), "--epochs", str(UNBOUNDED_EPOCHS), "--out", str(run_dir), "--no-progress",
            "--set", "optim.schedule=constant",  # the raw loop's learning rate is constant too
            "--set", f"train.timing_warmup_steps={point.warmup_steps}",
            "--set", "checkpoint.at_end=false"]  # outside the clock anyway; saves wall time
