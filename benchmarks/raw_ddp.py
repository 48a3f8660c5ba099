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
The pieces it shares with the other script sides are in ``raw_parts.py`` beside it: nodescale's
``cnn`` and ``digits`` *copied* (with them the script imports nothing from nodescale, so none of
nodescale's start-up lands in ``startup.py``'s baseline), nodescale's builders for any other
``--model``/``--dataset`` (the model code is not what is compared), the optimiser, the timing
and the flags. Kept equal to ``nodescale train``:

* the model (weights drawn after ``torch.manual_seed(seed)``), the training split (80/20 by
  ``randperm`` of a CPU generator seeded with the seed), the batch size per process and the
  number of optimiser steps;
* DistributedSampler-style data order: one permutation per epoch from ``seed + epoch``, padded
  by wrapping around, rank ``r`` taking positions ``r, r + W, ...``, the last batch of an epoch
  partial (23 steps per epoch for the digits on 2 ranks);
* inputs normalised per batch as ``(x / scale - mean) / std``, as nodescale does;
* DDP with gradients as bucket views and DDP's default bucketing (``--bucket-cap-mb 25`` gives
  nodescale's layout), AdamW (lr 3e-3, weight decay 0) or SGD (``--optimizer sgd``, ``--lr``,
  ``--momentum``), foreach on the CPU and fused on CUDA, a per-step cosine decay to 0 or a
  constant learning rate (``--schedule``);
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

import gc
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from raw_parts import cosine_factor, load, make_optimizer, make_parser, parse_args, sync, timing, write_result
from torch import nn
from torch.nn.parallel import DistributedDataParallel


# ------------------------------------------------------------------------------------ training
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


def ddp_bucket_sizes(ddp: DistributedDataParallel) -> list[int] | None:
    """DDP's gradient bucket sizes in bytes, as rebuilt after the first step (private API: None if absent)."""
    try:
        return [b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets()]
    except Exception:  # noqa: BLE001 - diagnostics only, never fail the benchmark for them
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, make_parser(__doc__.split("\n\n")[0]))
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
    optimizer = make_optimizer(args, ddp.parameters(), device)
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
            "schedule": args.schedule, "optimizer": args.optimizer, "lr": args.lr,
            "val_loss": val_loss, "val_accuracy": val_accuracy,
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
