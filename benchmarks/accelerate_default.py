"""The embedded default job of ``nodescale train``, as a Hugging Face Accelerate script.

One side of ``startup.py``, launched under torchrun as the Accelerate documentation allows
(``accelerate launch`` is a wrapper around the same launcher)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/accelerate_default.py --epochs 10 --json-out /tmp/accelerate.json

Same network, data, split and initial weights as ``raw_ddp.py`` (imported from ``raw_parts.py``),
AdamW (lr 3e-3, weight decay 0) with the per-step cosine decay to 0, batch 32 per process,
validation once per epoch over the whole validation split. ``Accelerator(cpu=True)`` sees
torchrun's variables, takes the ``MULTI_CPU`` path and starts a gloo process group (the
script records the backend); ``prepare`` wraps the model in DDP, the optimiser, and the two
``DataLoader``\\ s over ``TensorDataset``\\ s, which it shards batch by batch.

Differences that remain, inherent in the framework's idioms:

* Accelerate shards whole batches of one shuffled loader (rank r takes batches r, r + W,
  ...) instead of ``DistributedSampler``'s interleaved samples, and with its default
  ``even_batches=True`` it fills the last step of an epoch from the start of the epoch:
  still 23 steps per epoch on 2 processes, but 1,470 samples per epoch instead of 1,438
  (one extra full batch's worth, about 2% more samples in the epoch's last step).
* Batches are collated from single samples by the ``DataLoader``; the validation forward
  goes through the DDP wrapper (as in Accelerate's examples).
* The scheduler is not passed to ``prepare``: an ``AcceleratedScheduler`` steps the
  wrapped scheduler once per process per optimiser step (it assumes a schedule written for
  one process), which would decay twice as fast. Stepped directly, it follows the same
  per-step cosine as the other sides.

Rank 0 writes ``--json-out``: the final validation accuracy (``startup.py`` rejects a run
below 0.9), the optimiser steps, the unix time at which its first optimiser step returned
and the unix time at which training ended.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import accelerate
import torch
import torch.nn.functional as F
from accelerate import Accelerator

# The script's own directory is on sys.path when it is run as a script.
from raw_parts import (
    BATCH_SIZE,
    EPOCHS,
    LOG_EVERY,
    LR,
    WEIGHT_DECAY,
    build_model,
    cosine_factor,
    digits_tensors,
    write_result,
)
from torch.utils.data import DataLoader, TensorDataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS, help=f"passes over the training set (default {EPOCHS})")
    parser.add_argument("--json-out", type=Path, default=None, help="rank 0 writes its result here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    accelerator = Accelerator(cpu=True)
    x_train, y_train, x_val, y_val = digits_tensors()
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    train_loader = DataLoader(TensorDataset(x_train, y_train), batch_size=BATCH_SIZE, shuffle=True)
    val_loader = DataLoader(TensorDataset(x_val, y_val), batch_size=BATCH_SIZE, shuffle=False)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    total_steps = args.epochs * len(train_loader)  # len: this process's batches per epoch (23 on 2 processes)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: cosine_factor(step, total_steps))

    step = 0
    first_step_time: float | None = None
    val_loss = val_accuracy = float("nan")
    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if first_step_time is None:
                first_step_time = time.time()  # this process's first optimiser step has returned
            if step % LOG_EVERY == 0:
                reduced = accelerator.reduce(loss.detach(), reduction="mean")
                if accelerator.is_main_process:
                    print(f"step {step:>5}  loss {reduced.item():.4f}", flush=True)
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
        with torch.no_grad():
            for x, y in val_loader:
                output = model(x)
                # Drops the samples that even_batches repeated at the end: every one counted once.
                output, y = accelerator.gather_for_metrics((output, y))
                totals += torch.stack([F.cross_entropy(output, y, reduction="sum").double(),
                                       (output.argmax(1) == y).sum().double(), torch.tensor(len(y)).double()])
        loss_sum, hits, count = totals.tolist()  # gathered: already the totals over all ranks
        val_loss, val_accuracy = loss_sum / count, hits / count
        if accelerator.is_main_process:
            print(f"epoch {epoch + 1}/{args.epochs}  val_loss {val_loss:.4f}  val_acc {val_accuracy:.2%}", flush=True)

    if accelerator.is_main_process:
        write_result(args.json_out, {
            "side": "accelerate", "world_size": accelerator.num_processes, "epochs": args.epochs, "steps": step,
            "total_steps": total_steps, "batch_size_per_process": BATCH_SIZE, "val_loss": val_loss,
            "val_accuracy": val_accuracy, "first_step_time": first_step_time, "end_time": time.time(),
            "torch_threads": torch.get_num_threads(), "backend": accelerator.state.backend,
            "distributed_type": str(accelerator.distributed_type), "accelerate_version": accelerate.__version__,
        })
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group
    return 0


if __name__ == "__main__":
    sys.exit(main())
