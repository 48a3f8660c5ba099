"""A hand-written DDP training loop over in-memory data: the baseline of ``overhead.py`` and ``startup.py``.

Launched as one launches any hand-written DDP script::

    # The embedded default job of `nodescale train` (startup.py's baseline): cnn on the digits,
    # 10 epochs, cosine learning rate, validation every epoch.
    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/raw_ddp.py
    # A steady-state timing (overhead.py's baseline): a fixed number of steps, warm-up excluded.
    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/raw_ddp.py \\
        --model resnet18 --dataset synthetic --image-size 32 --batch-size 16 --steps 15 --warmup-steps 3 \\
        --schedule constant --no-validate

Everything -- process group, DDP wrapper, sampler, loss, optimiser, schedule, loop, validation
and timing -- is written out here as an expert would write it, with no framework in between.
nodescale's ``cnn`` and ``digits`` are *copied* here (with them the script imports nothing from
nodescale, so none of nodescale's start-up lands in ``startup.py``'s baseline);
``lightning_default.py`` and ``accelerate_default.py`` import them from this file. Any other
``--model``/``--dataset`` is built by nodescale's builders, because the model code is not what
is compared. Kept equal to ``nodescale train``:

* the model (weights drawn after ``torch.manual_seed(seed)``), the training split (80/20 by
  ``randperm`` of a CPU generator seeded with the seed), the batch size per process and the
  number of optimiser steps;
* DistributedSampler-style data order: one permutation per epoch from ``seed + epoch``, padded
  by wrapping around, rank ``r`` taking positions ``r, r + W, ...``, the last batch of an epoch
  partial (23 steps per epoch for the digits on 2 ranks);
* inputs normalised per batch as ``(x / scale - mean) / std``, as nodescale does;
* DDP with gradients as bucket views and DDP's default bucketing (``--bucket-cap-mb 25`` gives
  nodescale's layout), AdamW (lr 3e-3, weight decay 0; foreach on the CPU, fused on CUDA),
  a per-step cosine decay to 0 or a constant learning rate (``--schedule``);
* the loss all-reduced and printed every ``--log-every`` steps (nodescale reduces its metrics
  at the same interval); validation once per epoch over the whole validation split, sharded,
  padding masked out, on the unwrapped model (``--no-validate`` to skip; it is not paused out
  of the timing);
* timing: the first ``--warmup-steps`` steps are excluded; the device is synchronised and all
  ranks meet at a barrier before the clock starts and before it stops; throughput counts the
  samples of all ranks.

Rank 0 prints one JSON line (prefixed ``RESULT``; ``--json-out`` writes it to a file too):
the timing, the final validation accuracy and the unix time at which its first optimiser step
returned.
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


# ------------------------------------------------------------------------------------ training
def load(args: argparse.Namespace) -> tuple[nn.Module, list[torch.Tensor], tuple[float, tuple, tuple]]:
    """The model, ``[x_train, y_train, x_val, y_val]`` and ``(scale, mean, std)`` of the inputs."""
    if (args.model, args.dataset) == ("cnn", "digits"):
        return build_model(args.seed), list(digits_pixels(args.seed)), (SCALE, (MEAN,), (STD,))
    # Any other model and data: nodescale's builders (imported only here, see the docstring).
    from nodescale.config.schema import DataSection, ModelSection
    from nodescale.data.arrays import ArrayDataset
    from nodescale.data.registry import get_format
    from nodescale.models.registry import build_model as build_nodescale

    splits = get_format(args.dataset).load(
        DataSection(name=args.dataset, image_size=args.image_size, samples=args.samples), args.seed)
    train, val = splits.train, splits.val
    if not isinstance(train, ArrayDataset) or not isinstance(val, ArrayDataset):
        raise SystemExit(f"raw_ddp.py needs an in-memory dataset; {args.dataset!r} is read from files")
    torch.manual_seed(args.seed)
    model = build_nodescale(ModelSection(name=args.model), splits.spec)
    return model, [train.x, train.y, val.x, val.y], (train.scale, train.mean, train.std)


def shard(num_samples: int, rank: int, world: int, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's positions of ``order`` padded by wrapping around (DistributedSampler's), and the real-sample mask."""
    padded_length = math.ceil(num_samples / world) * world
    padded = order.repeat(math.ceil(padded_length / num_samples))[:padded_length]
    positions = torch.arange(rank, padded_length, world)
    return padded[positions], positions < num_samples


def validate(model: nn.Module, x_val: torch.Tensor, y_val: torch.Tensor, normalise: Any, batch_size: int,
             rank: int, world: int) -> tuple[float, float]:
    """Loss and accuracy over every validation sample exactly once, all ranks taking part."""
    indices, real = shard(len(x_val), rank, world, torch.arange(len(x_val)))
    indices, real = indices.to(x_val.device), real.to(x_val.device)
    totals = torch.zeros(3, dtype=torch.float64, device=x_val.device)  # loss sum, correct, count
    model.eval()
    with torch.no_grad():
        for first in range(0, len(indices), batch_size):
            batch, weights = indices[first:first + batch_size], real[first:first + batch_size].float()
            output = model(normalise(x_val[batch]))
            totals[0] += (F.cross_entropy(output, y_val[batch], reduction="none") * weights).sum()
            totals[1] += ((output.argmax(1) == y_val[batch]).float() * weights).sum()
            totals[2] += weights.sum()
    model.train()
    dist.all_reduce(totals)
    loss_sum, hits, count = totals.tolist()
    return loss_sum / count, hits / count


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


def ddp_bucket_sizes(ddp: DistributedDataParallel) -> list[int] | None:
    """DDP's gradient bucket sizes in bytes, as rebuilt after the first step (private API: None if absent)."""
    try:
        return [b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets()]
    except Exception:  # noqa: BLE001 - diagnostics only, never fail the benchmark for them
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn", help="model (cnn: the copy here; others: nodescale's builder)")
    parser.add_argument("--dataset", default="digits", help="in-memory dataset (digits: the copy here)")
    parser.add_argument("--image-size", type=int, default=None, help="synthetic: image side (data.image_size)")
    parser.add_argument("--samples", type=int, default=2048, help="synthetic: training samples (data.samples)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="samples per process per step")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help=f"passes over the training set (default {EPOCHS})")
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps in total, warm-up included "
                        "(default: --epochs worth)")
    parser.add_argument("--warmup-steps", type=int, default=0, help="first steps excluded from the timing")
    parser.add_argument("--schedule", choices=("cosine", "constant"), default="cosine", help="learning rate")
    parser.add_argument("--no-validate", dest="validate", action="store_false", help="no validation per epoch")
    parser.add_argument("--lr", type=float, default=LR, help="AdamW learning rate (peak)")
    parser.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY, help="AdamW weight decay")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP bucket_cap_mb; default: DDP's own (1 MiB first bucket, then 25 MiB)")
    parser.add_argument("--seed", type=int, default=SEED, help="seed of the weights, the split and the data order")
    parser.add_argument("--log-every", type=int, default=LOG_EVERY, help="steps between loss reductions (0: never)")
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto", help="auto: CUDA when there is one")
    parser.add_argument("--json-out", type=Path, default=None, help="rank 0 writes the result here")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps <= args.warmup_steps:
        parser.error(f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "auto" and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")

    model, data, (scale, mean, std) = load(args)
    x_train, y_train, x_val, y_val = (t.to(device) for t in data)
    stat_shape = (1, -1) + (1,) * (x_train.dim() - 2)
    mean_t = torch.tensor(mean, device=device).view(stat_shape)
    std_t = torch.tensor(std, device=device).view(stat_shape)

    def normalise(x: torch.Tensor) -> torch.Tensor:
        return (x.float() / scale - mean_t) / std_t

    model = model.to(device)
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # no copy between .grad and the all-reduce buckets
        # None keeps DDP's default bucketing: a small first bucket (1 MiB) so the first
        # all-reduce starts early in backward, then 25 MiB buckets. Any explicit value,
        # even 25, makes every bucket that size.
        bucket_cap_mb=args.bucket_cap_mb,
    )
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  **({"fused": True} if device.type == "cuda" else {}))
    steps_per_epoch = math.ceil(math.ceil(len(x_train) / world) / args.batch_size)
    total_steps = args.steps or args.epochs * steps_per_epoch
    scheduler = None if args.schedule == "constant" else torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_factor(step, total_steps))

    step = timed_samples = 0
    first_step_time: float | None = None
    val_loss = val_accuracy = float("nan")
    ddp.train()
    dist.barrier()
    started = time.perf_counter()  # replaced at the end of warm-up unless there is none
    for epoch in range(math.ceil(total_steps / steps_per_epoch)):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(args.seed + epoch))
        indices = shard(len(x_train), rank, world, order)[0].to(device)  # padding trains, as DistributedSampler
        for first in range(0, len(indices), args.batch_size):
            batch = indices[first:first + args.batch_size]
            loss = F.cross_entropy(ddp(normalise(x_train[batch])), y_train[batch])
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if first_step_time is None:
                first_step_time = time.time()  # rank 0's first optimiser step has returned
            if step > args.warmup_steps:
                timed_samples += len(batch)
            if args.log_every and step % args.log_every == 0:
                reduced = loss.detach().clone()
                dist.all_reduce(reduced)
                if rank == 0:
                    print(f"step {step:>6}  loss {reduced.item() / world:.4f}", flush=True)
            if step == args.warmup_steps:
                # Steady state starts here: every rank done with warm-up, device idle.
                sync(device)
                dist.barrier()
                started = time.perf_counter()
            if step == total_steps:
                break
        if args.validate:
            val_loss, val_accuracy = validate(model, x_val, y_val, normalise, args.batch_size, rank, world)
            if rank == 0:
                print(f"epoch {epoch + 1}  val_loss {val_loss:.4f}  val_acc {val_accuracy:.2%}", flush=True)
    sync(device)
    dist.barrier()
    elapsed = time.perf_counter() - started

    timed = timing(elapsed, timed_samples, total_steps - args.warmup_steps, device)
    if rank == 0:
        write_result(args.json_out, {
            "side": "raw", "model": args.model, "dataset": args.dataset, "world_size": world,
            "batch_size_per_process": args.batch_size, "steps": step, "total_steps": total_steps,
            "timing_warmup_steps": args.warmup_steps, **timed,
            "schedule": args.schedule, "val_loss": val_loss, "val_accuracy": val_accuracy,
            "first_step_time": first_step_time, "end_time": time.time(),
            "bucket_cap_mb": args.bucket_cap_mb, "ddp_bucket_sizes": ddp_bucket_sizes(ddp),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
            "device": str(device), "backend": dist.get_backend(), "torch_version": torch.__version__,
        })

    # Drop gloo's pending work objects while the group still exists, then leave together:
    # tearing down with work in flight crashes at interpreter exit.
    del ddp, model, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
