"""The pieces every hand-written and framework side of the benchmarks shares.

nodescale's ``cnn`` and ``digits`` *copied* (with them ``raw_ddp.py`` imports nothing from
nodescale for the embedded default job, so none of nodescale's start-up lands in
``startup.py``'s baseline); any other ``--model``/``--dataset`` built by nodescale's builders
(the model code is not what is compared); the optimiser; the steady-state timing and the
``RESULT`` line; and the flags of ``raw_ddp.py``, which ``library_ddp.py``,
``lightning_loop.py`` and ``accelerate_loop.py`` take too, so that ``overhead.py`` gives every
side the same job in the same words.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

# The embedded default of `nodescale train` (`nodescale config show`).
SEED = 0
BATCH_SIZE = 32  # per process
LR = 3e-3
WEIGHT_DECAY = 0.0
MOMENTUM = 0.9  # SGD only
EPOCHS = 10
VAL_FRACTION = 0.2
LOG_EVERY = 10
# src/nodescale/data/digits.py: pixels are counts 0..16; mean and std of all pixels / 16.
SCALE = 16.0
MEAN = 0.30526
STD = 0.37605
NUM_CLASSES = 10


# ------------------------------------------------------------------ model (copied from nodescale)
class ConvBlock(nn.Module):
    """5x5 convolution (size-preserving), BatchNorm, ReLU, then 2x2 max-pooling."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=5, padding=2)
        self.bn = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.relu(self.bn(self.conv(x))))


class ConvNet(nn.Module):
    """nodescale's ``cnn``: ``layer1`` (16 channels) and ``layer2`` (32 channels), then ``fc``."""

    def __init__(self, channels: int = 1, height: int = 8, width: int = 8, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.layer1 = ConvBlock(channels, 16)
        self.layer2 = ConvBlock(16, 32)
        # Each block halves the sides (rounding down), hence the // 4.
        self.fc = nn.Linear(32 * (height // 4) * (width // 4), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer2(self.layer1(x))
        return self.fc(out.flatten(1))


def build_model(seed: int = SEED) -> ConvNet:
    """The network with the weights every side starts from (nodescale seeds before building)."""
    torch.manual_seed(seed)
    return ConvNet()


# ------------------------------------------------------------------- data (copied from nodescale)
def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """Pixels as uint8 ``(1797, 64)`` in 0..16 and labels as int64, from sklearn's CSV without importing sklearn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",", dtype=np.uint8)  # 64 pixels, then the label
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # an installation laid out differently

    bunch = load_digits()
    return bunch.data.astype(np.uint8), bunch.target.astype(np.int64)


def seeded_split(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted training and validation indices, as nodescale draws them (``src/nodescale/data/split.py``)."""
    n_val = min(max(round(n * val_fraction), 1), n - 1)
    order = torch.randperm(n, generator=torch.Generator(device="cpu").manual_seed(seed))
    val, _ = order[:n_val].sort()
    train, _ = order[n_val:].sort()
    return train, val


def digits_pixels(seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_val, y_val)``: uint8 ``(N, 1, 8, 8)`` pixels and int64 labels."""
    pixels, labels = read_digits()
    x = torch.from_numpy(np.ascontiguousarray(pixels)).view(-1, 1, 8, 8)
    y = torch.from_numpy(labels)
    train, val = seeded_split(len(x), VAL_FRACTION, seed)
    return x[train], y[train], x[val], y[val]


def digits_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``digits_pixels`` with the inputs normalised once, as float32 (for the frameworks' DataLoaders)."""
    x_train, y_train, x_val, y_val = digits_pixels()
    return (x_train.float() / SCALE - MEAN) / STD, y_train, (x_val.float() / SCALE - MEAN) / STD, y_val


def cosine_factor(step: int, total_steps: int) -> float:
    """Multiplier of the peak lr before optimiser step ``step`` (0-based): nodescale's cosine, no warm-up."""
    progress = min(1.0, step / max(1, total_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def write_result(path: Path | None, result: dict[str, Any]) -> None:
    """Print the result as one ``RESULT`` line and write it to ``path`` (rank 0 only calls this)."""
    print("RESULT " + json.dumps(result), flush=True)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


# ------------------------------------------------------------------ what every script side shares
def load(args: argparse.Namespace) -> tuple[nn.Module, list[torch.Tensor], tuple[float, tuple, tuple]]:
    """The model, ``[x_train, y_train, x_val, y_val]`` and ``(scale, mean, std)`` of the inputs."""
    if (args.model, args.dataset) == ("cnn", "digits"):
        return build_model(args.seed), list(digits_pixels(args.seed)), (SCALE, (MEAN,), (STD,))
    # Any other model and data: nodescale's builders (imported only here, see the docstring).
    from nodescale.config.schema import DataSection, ModelSection
    from nodescale.data.arrays import ArrayDataset
    from nodescale.data.registry import get_format
    from nodescale.models.registry import build_model as build_nodescale

    splits = get_format(args.dataset).load(DataSection(
        name=args.dataset, image_size=args.image_size, samples=args.samples, channels=args.channels), args.seed)
    train, val = splits.train, splits.val
    if not isinstance(train, ArrayDataset) or not isinstance(val, ArrayDataset):
        raise SystemExit(f"{args.dataset!r} is read from files; these scripts need an in-memory dataset")
    torch.manual_seed(args.seed)
    model = build_nodescale(ModelSection(name=args.model), splits.spec)
    return model, [train.x, train.y, val.x, val.y], (train.scale, train.mean, train.std)


def training_tensors(args: argparse.Namespace) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model and the training split with its inputs normalised once, as float32: what a framework's
    ``DataLoader`` over a ``TensorDataset`` takes (the loops in this folder normalise per batch instead)."""
    model, (x, y, _, _), (scale, mean, std) = load(args)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return model, (x.float() / scale - torch.tensor(mean).view(shape)) / torch.tensor(std).view(shape), y


def make_optimizer(args: argparse.Namespace, params: Any, device: torch.device) -> torch.optim.Optimizer:
    """AdamW or SGD as ``--optimizer`` says (nodescale's ``optim.name``); fused on CUDA, foreach on the CPU."""
    fused = {"fused": True} if device.type == "cuda" else {}
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay, **fused)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, **fused)


def sync(device: torch.device) -> None:
    """Wait for queued device work; CPU ops are synchronous already."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timing(elapsed: float, timed_samples: int, timed_steps: int, device: torch.device) -> dict[str, Any]:
    """Every rank: the timed steps' figures from the slowest rank's time (they are equal up to the
    barrier) and all ranks' samples."""
    slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
    samples = torch.tensor([float(timed_samples)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(samples)
    return {"timed_steps": timed_steps, "timed_samples": int(samples.item()), "timed_seconds": slowest.item(),
            "step_seconds": slowest.item() / timed_steps, "samples_per_second": samples.item() / slowest.item()}


def make_parser(description: str) -> argparse.ArgumentParser:
    """``raw_ddp.py``'s flags: the job (model, data, batch, steps, optimiser) and its timing."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="cnn", help="model (cnn: the copy here; others: nodescale's builder)")
    parser.add_argument("--dataset", default="digits", help="in-memory dataset (digits: the copy here)")
    parser.add_argument("--image-size", type=int, default=None, help="synthetic: image side (data.image_size)")
    parser.add_argument("--channels", type=int, default=3, help="synthetic: image channels (data.channels)")
    parser.add_argument("--samples", type=int, default=2048, help="synthetic: training samples (data.samples)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="samples per process per step")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help=f"passes over the training set (default {EPOCHS})")
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps in total, warm-up included "
                        "(default: --epochs worth)")
    parser.add_argument("--warmup-steps", type=int, default=0, help="first steps excluded from the timing")
    parser.add_argument("--schedule", choices=("cosine", "constant"), default="cosine", help="learning rate")
    parser.add_argument("--no-validate", dest="validate", action="store_false", help="no validation per epoch")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="nodescale's optim.name")
    parser.add_argument("--lr", type=float, default=LR, help="learning rate (peak)")
    parser.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY, help="weight decay (decoupled for AdamW)")
    parser.add_argument("--momentum", type=float, default=MOMENTUM, help="SGD momentum (nodescale's optim.momentum)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP bucket_cap_mb; default: DDP's own (1 MiB first bucket, then 25 MiB)")
    parser.add_argument("--seed", type=int, default=SEED, help="seed of the weights, the split and the data order")
    parser.add_argument("--log-every", type=int, default=LOG_EVERY, help="steps between loss reductions (0: never)")
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto", help="auto: CUDA when there is one")
    parser.add_argument("--json-out", type=Path, default=None, help="rank 0 writes the result here")
    return parser


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None,
               need_steps: bool = False) -> argparse.Namespace:
    """``argv`` parsed by ``parser`` (default: ``make_parser``'s); ``need_steps``: a timing-only side."""
    parser = parser or make_parser(__doc__.split("\n\n")[0])
    args = parser.parse_args(argv)
    if need_steps and args.steps is None:
        parser.error("--steps is required: this side only times a fixed number of steps")
    if args.steps is not None and args.steps <= args.warmup_steps:
        parser.error(f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps})")
    return args
