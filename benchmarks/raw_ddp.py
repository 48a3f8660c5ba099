"""A hand-written DDP training loop: the baseline that nodescale's overhead is measured against.

Launch it the way one launches any hand-written DDP script::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/raw_ddp.py --model cnn --dataset digits --batch-size 32 --steps 300

Only the model and the data come from nodescale (``build_model`` and the dataset
formats), because the model code is not what is being compared: everything
else -- process group, DDP wrapper, sampler, loss, optimiser, loop and timing
-- is written out here as an expert would write it by hand, with no framework
in between.

What is kept equal to ``nodescale train`` so that the two do the same work:

* the same model (built from the same seed), the same training split, the
  same per-process batch size and the same number of optimiser steps;
* DistributedSampler-style data order: one permutation per epoch drawn from
  ``seed + epoch``, padded by wrapping around, rank ``r`` taking positions
  ``r, r + W, ...``, the last batch of an epoch partial;
* inputs normalised per batch as ``(x / scale - mean) / std`` (what nodescale
  does for its in-memory datasets);
* DDP with gradients as bucket views, AdamW with the same lr and weight decay
  (foreach on the CPU, fused on CUDA), a constant learning rate;
* the loss all-reduced and printed every ``--log-every`` steps (nodescale
  reduces its metrics at the same interval);
* timing: the first ``--warmup-steps`` optimiser steps are excluded, the
  device is synchronised and all ranks meet at a barrier before the clock
  starts and before it stops; throughput counts the samples of all ranks
  (padding repeats included; the benchmark cases have none, and
  ``overhead.py`` checks that both sides timed the same number of samples).

Rank 0 prints one JSON line (prefixed ``RAW_DDP_RESULT``) and, with
``--json-out``, writes the same object to a file.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from nodescale.config.schema import DataSection, ModelSection
from nodescale.data.arrays import ArrayDataset
from nodescale.data.registry import get_format
from nodescale.models.registry import build_model

RESULT_PREFIX = "RAW_DDP_RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn", help="nodescale model name (built with nodescale's builder)")
    parser.add_argument("--dataset", default="digits", help="nodescale in-memory dataset name")
    parser.add_argument("--image-size", type=int, default=None, help="synthetic: image side (data.image_size)")
    parser.add_argument("--samples", type=int, default=2048, help="synthetic: training samples (data.samples)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per process per step")
    parser.add_argument("--steps", type=int, default=300, help="optimiser steps in total, warm-up included")
    parser.add_argument("--warmup-steps", type=int, default=5, help="first steps excluded from the timing")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (constant)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP bucket_cap_mb; default: DDP's own (1 MiB first bucket, then 25 MiB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, the split and the data order")
    parser.add_argument("--log-every", type=int, default=10, help="steps between loss reductions (0: never)")
    parser.add_argument("--json-out", type=Path, default=None, help="rank 0 writes the result here")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup_steps:
        parser.error(f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps})")
    return args


def sync(device: torch.device) -> None:
    """Wait for queued device work; CPU ops are synchronous already."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def epoch_indices(num_samples: int, epoch: int, seed: int, rank: int, world: int) -> torch.Tensor:
    """This rank's sample indices for ``epoch``, as ``DistributedSampler(shuffle=True, drop_last=False)``."""
    generator = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(num_samples, generator=generator)
    padded_length = math.ceil(num_samples / world) * world
    order = order.repeat(math.ceil(padded_length / num_samples))[:padded_length]
    return order[rank::world]


def ddp_bucket_sizes(ddp: DistributedDataParallel) -> list[int] | None:
    """DDP's gradient bucket sizes in bytes, as rebuilt after the first step (private API: None if absent)."""
    try:
        return [b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets()]
    except Exception:  # noqa: BLE001 - diagnostics only, never fail the benchmark for them
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")

    # Data: the dataset in memory, batches cut by indexing its tensors.
    data_cfg = DataSection(name=args.dataset, image_size=args.image_size, samples=args.samples)
    splits = get_format(args.dataset).load(data_cfg, args.seed)
    train = splits.train
    if not isinstance(train, ArrayDataset):
        raise SystemExit(f"raw_ddp.py needs an in-memory dataset; {args.dataset!r} is read from files")
    x_all, y_all = train.x.to(device), train.y.to(device)
    stat_shape = (1, -1) + (1,) * (x_all.dim() - 2)
    mean = torch.tensor(train.mean, device=device).view(stat_shape)
    std = torch.tensor(train.std, device=device).view(stat_shape)
    scale = train.scale

    # Model: identical initial weights on every rank, as nodescale seeds them.
    torch.manual_seed(args.seed)
    model = build_model(ModelSection(name=args.model), splits.spec).to(device)
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # no copy between .grad and the all-reduce buckets
        # None keeps DDP's default bucketing: a small first bucket (1 MiB) so the first
        # all-reduce starts early in backward, then 25 MiB buckets. Any explicit value,
        # even 25, makes every bucket that size.
        bucket_cap_mb=args.bucket_cap_mb,
    )
    optimizer = torch.optim.AdamW(
        ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay,
        **({"fused": True} if device.type == "cuda" else {}),
    )

    step = 0
    epoch = 0
    timed_samples = 0
    ddp.train()
    dist.barrier()
    started = time.perf_counter()  # replaced at the end of warm-up unless there is none
    while step < args.steps:
        indices = epoch_indices(len(x_all), epoch, args.seed, rank, world).to(device)
        for first in range(0, len(indices), args.batch_size):
            batch = indices[first:first + args.batch_size]
            x = (x_all[batch].float() / scale - mean) / std
            y = y_all[batch]
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
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
            if step == args.steps:
                break
        epoch += 1
    sync(device)
    dist.barrier()
    elapsed = time.perf_counter() - started

    write_result(args, rank, world, device, elapsed, timed_samples, {"ddp_bucket_sizes": ddp_bucket_sizes(ddp)})

    # Drop gloo's pending work objects while the group still exists, then leave
    # together: tearing down with work in flight crashes at interpreter exit.
    del ddp, model, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def write_result(args: argparse.Namespace, rank: int, world: int, device: torch.device, elapsed: float,
                 timed_samples: int, extra: dict[str, Any]) -> None:
    """Every rank: reduce the time (slowest rank) and samples (all ranks); rank 0 prints and writes the result."""
    # Slowest rank's time (they are equal up to the barrier) and all ranks' samples.
    totals = torch.tensor([elapsed, float(timed_samples)], dtype=torch.float64, device=device)
    slowest = totals[:1].clone()
    samples = totals[1:].clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(samples)
    timed_steps = args.steps - args.warmup_steps
    result: dict[str, Any] = {
        "model": args.model,
        "dataset": args.dataset,
        "world_size": world,
        "batch_size_per_process": args.batch_size,
        "steps": args.steps,
        "timing_warmup_steps": args.warmup_steps,
        "timed_steps": timed_steps,
        "timed_samples": int(samples.item()),
        "timed_seconds": slowest.item(),
        "step_seconds": slowest.item() / timed_steps,
        "samples_per_second": samples.item() / slowest.item(),
        "bucket_cap_mb": args.bucket_cap_mb,
        **extra,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "torch_version": torch.__version__,
    }
    if rank == 0:
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        if args.json_out is not None:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
