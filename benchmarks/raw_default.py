"""The embedded default job of ``nodescale train``, written out as a plain PyTorch DDP script.

The baseline of ``startup.py``. Launch it as one launches any hand-written DDP script::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/raw_default.py --epochs 10 --json-out /tmp/raw.json

Unlike ``raw_ddp.py`` (which builds the model and data with nodescale's own builders,
because it compares training loops), this script imports nothing from nodescale: start-up
is what ``startup.py`` compares, and importing nodescale would put part of nodescale's
start-up into the baseline. The network and the data are therefore *copied* here, and
``lightning_default.py`` and ``accelerate_default.py`` import them from this file, so all
three non-nodescale sides train the very same network on the very same data:

* the model is nodescale's ``cnn`` (``src/nodescale/models/cnn.py``): two blocks of 5x5
  convolution, BatchNorm, ReLU and 2x2 max-pooling (16 and 32 channels), then a linear
  layer, weights drawn after ``torch.manual_seed(0)``;
* the data is nodescale's ``digits``: scikit-learn's 1,797 8x8 digits, read from the CSV
  file inside the installed sklearn package exactly as ``src/nodescale/data/digits.py``
  does (``import sklearn`` alone costs about a second, so reading the file keeps that cost
  out of every side alike), split 80/20 by ``randperm`` of a CPU generator seeded with 0
  (``src/nodescale/data/split.py``), pixels normalised as ``(x / 16 - 0.30526) / 0.37605``;
* AdamW, lr 3e-3, weight decay 0 (nodescale's default, not AdamW's 0.01), a per-step
  cosine decay to 0 over all steps (``src/nodescale/train/optim.py``), batch 32 per
  process, cross-entropy averaged over the batch;
* DistributedSampler-style order: one permutation per epoch from ``seed + epoch``, padded
  by wrapping around, rank ``r`` taking positions ``r, r + W, ...``, the last batch of an
  epoch partial (23 steps per epoch on 2 ranks, the same samples nodescale draws);
* validation once per epoch over the whole validation split, sharded over the ranks,
  padding masked out, loss and accuracy summed and all-reduced (what nodescale's
  ``evaluate`` does), on the unwrapped model so no DDP buffer broadcast runs;
* the training loss all-reduced and printed every 10 steps (nodescale reduces its
  metrics every ``log_every`` = 10 steps).

Inputs are normalised once, up front, rather than per batch as nodescale does: a few
microseconds per step, which a hand-written script would not spend.

Rank 0 writes ``--json-out``: the final validation accuracy (``startup.py`` rejects a run
below 0.9), the number of optimiser steps, the unix time at which its first optimiser step
returned and the unix time at which it finished.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# The embedded default of `nodescale train` (`nodescale config show`).
SEED = 0
BATCH_SIZE = 32  # per process
LR = 3e-3
WEIGHT_DECAY = 0.0
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


def build_model() -> ConvNet:
    """The network with the weights every side starts from (nodescale seeds before building)."""
    torch.manual_seed(SEED)
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


def digits_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_val, y_val)``: float32 ``(N, 1, 8, 8)`` inputs, normalised, and int64 labels."""
    pixels, labels = read_digits()
    x = (torch.from_numpy(np.ascontiguousarray(pixels)).view(-1, 1, 8, 8).float() / SCALE - MEAN) / STD
    y = torch.from_numpy(labels)
    train, val = seeded_split(len(x), VAL_FRACTION, SEED)
    return x[train], y[train], x[val], y[val]


def cosine_factor(step: int, total_steps: int) -> float:
    """Multiplier of the peak lr before optimiser step ``step`` (0-based): nodescale's cosine, no warm-up."""
    progress = min(1.0, step / max(1, total_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def write_result(path: Path | None, result: dict[str, Any]) -> None:
    """Print the result as one line and write it to ``path`` (rank 0 only calls this)."""
    print("RESULT " + json.dumps(result), flush=True)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


# ------------------------------------------------------------------------------------ training
def shard(num_samples: int, rank: int, world: int, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's positions of ``order`` padded by wrapping around (DistributedSampler's), and the real-sample mask."""
    padded_length = math.ceil(num_samples / world) * world
    padded = order.repeat(math.ceil(padded_length / num_samples))[:padded_length]
    positions = torch.arange(rank, padded_length, world)
    return padded[positions], positions < num_samples


def validate(model: nn.Module, x_val: torch.Tensor, y_val: torch.Tensor, rank: int, world: int) -> tuple[float, float]:
    """Loss and accuracy over every validation sample exactly once, all ranks taking part."""
    indices, real = shard(len(x_val), rank, world, torch.arange(len(x_val)))
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    model.eval()
    with torch.no_grad():
        for first in range(0, len(indices), BATCH_SIZE):
            batch, weights = indices[first:first + BATCH_SIZE], real[first:first + BATCH_SIZE].float()
            output = model(x_val[batch])
            totals[0] += (F.cross_entropy(output, y_val[batch], reduction="none") * weights).sum()
            totals[1] += ((output.argmax(1) == y_val[batch]).float() * weights).sum()
            totals[2] += weights.sum()
    model.train()
    dist.all_reduce(totals)
    loss_sum, hits, count = totals.tolist()
    return loss_sum / count, hits / count


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS, help=f"passes over the training set (default {EPOCHS})")
    parser.add_argument("--json-out", type=Path, default=None, help="rank 0 writes its result here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")  # CPU only: the benchmark compares CPU start-up

    x_train, y_train, x_val, y_val = digits_tensors()
    model = build_model()
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)  # as nodescale and raw_ddp.py
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    steps_per_epoch = math.ceil(math.ceil(len(x_train) / world) / BATCH_SIZE)
    total_steps = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: cosine_factor(step, total_steps))

    step = 0
    first_step_time: float | None = None
    val_loss = val_accuracy = float("nan")
    ddp.train()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(SEED + epoch))
        indices, _ = shard(len(x_train), rank, world, order)  # padding (none on 2 ranks) trains, as DistributedSampler
        for first in range(0, len(indices), BATCH_SIZE):
            batch = indices[first:first + BATCH_SIZE]
            loss = F.cross_entropy(ddp(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if first_step_time is None:
                first_step_time = time.time()  # rank 0's first optimiser step has returned
            if step % LOG_EVERY == 0:
                reduced = loss.detach().clone()
                dist.all_reduce(reduced)
                if rank == 0:
                    print(f"step {step:>5}  loss {reduced.item() / world:.4f}", flush=True)
        val_loss, val_accuracy = validate(model, x_val, y_val, rank, world)  # the module: no DDP forward
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  val_loss {val_loss:.4f}  val_acc {val_accuracy:.2%}", flush=True)

    if rank == 0:
        write_result(args.json_out, {
            "side": "raw", "world_size": world, "epochs": args.epochs, "steps": step, "total_steps": total_steps,
            "batch_size_per_process": BATCH_SIZE, "val_loss": val_loss, "val_accuracy": val_accuracy,
            "first_step_time": first_step_time, "end_time": time.time(), "torch_threads": torch.get_num_threads(),
            "backend": dist.get_backend(),
        })
    # Drop gloo's pending work objects while the group exists, then leave together.
    del ddp, model, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
