"""The embedded default job of ``nodescale train``, as a PyTorch Lightning script.

One side of ``startup.py``. Started as a plain script; Lightning's ``strategy="ddp"`` starts
the other processes itself (it runs this script again with ``LOCAL_RANK`` set)::

    OMP_NUM_THREADS=1 python benchmarks/lightning_default.py --epochs 10 --json-out /tmp/lightning.json

Same network, data, split and initial weights as ``raw_ddp.py`` (imported from ``raw_parts.py``),
AdamW (lr 3e-3, weight decay 0) with the per-step cosine decay to 0, batch 32 per process,
2 processes on the CPU, validation once per epoch over the whole validation split. Written
the way the Lightning documentation writes it: a ``LightningModule``, ``DataLoader``\\ s over
``TensorDataset``\\ s (Lightning inserts the ``DistributedSampler``\\ s: shuffled with seed
0 and ``set_epoch`` for training, in order for validation) and ``Trainer.fit``.

Trainer settings and why:

* ``accelerator="cpu", devices=N, strategy="ddp"``: N processes, DDP over gloo, which is
  Lightning's backend for the CPU (the script checks it and records it);
* ``enable_checkpointing=False, logger=False, enable_progress_bar=False,
  enable_model_summary=False``: no output the other sides do not produce either;
* ``num_sanity_val_steps=0``: by default Lightning runs 2 validation batches before
  training ("sanity check"); the other sides validate only once per epoch, so it is off,
  which can only make Lightning's start-up shorter.

Differences that remain, inherent in the framework's idioms: batches are collated from
single samples by the ``DataLoader`` (the raw script and nodescale index tensors); the
validation forward goes through the DDP wrapper (Lightning's strategy does that; it
broadcasts BatchNorm buffers per batch); ``DistributedSampler`` pads the 359 validation
samples to 360 (one sample counted twice in the sanity-check accuracy, which is not timed
anyway); the training loss is not all-reduced every 10 steps (``self.log`` without a
logger keeps it on the rank).

Global rank 0 writes ``--json-out``: the final validation accuracy (``startup.py`` rejects a
run below 0.9), the optimiser steps, the unix time of its first ``on_train_batch_end`` (the
first optimiser step has returned) and the unix time at which ``fit`` returned.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

# The script's own directory is on sys.path when it is run as a script (and so in
# the processes Lightning starts, which run it again).
from raw_parts import BATCH_SIZE, EPOCHS, LR, WEIGHT_DECAY, build_model, cosine_factor, digits_tensors, write_result
from torch.utils.data import DataLoader, TensorDataset


class DigitsModule(L.LightningModule):
    """nodescale's ``cnn`` on the digits, with validation loss and accuracy summed over all ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build_model()
        self.val_totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
        self.val_loss = float("nan")
        self.val_accuracy = float("nan")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)  # kept on the rank: no logger, no sync_dist
        return loss

    def on_validation_epoch_start(self) -> None:
        self.val_totals.zero_()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        output = self(x)
        self.val_totals[0] += F.cross_entropy(output, y, reduction="sum").item()
        self.val_totals[1] += (output.argmax(1) == y).sum().item()
        self.val_totals[2] += len(y)

    def on_validation_epoch_end(self) -> None:
        totals = self.trainer.strategy.reduce(self.val_totals.clone(), reduce_op="sum")  # one all-reduce
        loss_sum, hits, count = totals.tolist()
        self.val_loss, self.val_accuracy = loss_sum / count, hits / count
        if self.trainer.is_global_zero:
            print(f"epoch {self.current_epoch + 1}/{self.trainer.max_epochs}  val_loss {self.val_loss:.4f}  "
                  f"val_acc {self.val_accuracy:.2%}", flush=True)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        total_steps = int(self.trainer.estimated_stepping_batches)  # 23 per epoch on 2 processes
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: cosine_factor(step, total_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class FirstStep(L.Callback):
    """The unix time at which the first training batch (its optimiser step included) ended."""

    def __init__(self) -> None:
        self.time: float | None = None
        self.steps = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.time is None:
            self.time = time.time()
        self.steps += 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS, help=f"passes over the training set (default {EPOCHS})")
    parser.add_argument("--nproc", type=int, default=2, help="processes (Lightning's devices; default 2)")
    parser.add_argument("--json-out", type=Path, default=None, help="global rank 0 writes its result here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    x_train, y_train, x_val, y_val = digits_tensors()
    train_loader = DataLoader(TensorDataset(x_train, y_train), batch_size=BATCH_SIZE, shuffle=True)
    val_loader = DataLoader(TensorDataset(x_val, y_val), batch_size=BATCH_SIZE, shuffle=False)
    module = DigitsModule()
    first_step = FirstStep()
    trainer = L.Trainer(
        accelerator="cpu", devices=args.nproc, strategy="ddp", max_epochs=args.epochs,
        enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,  # the other sides run no validation before training
        callbacks=[first_step],
    )
    trainer.fit(module, train_loader, val_loader)
    if trainer.is_global_zero:
        backend = trainer.strategy.process_group_backend if hasattr(trainer.strategy, "process_group_backend") else None
        write_result(args.json_out, {
            "side": "lightning", "world_size": trainer.world_size, "epochs": trainer.current_epoch,
            "steps": trainer.global_step, "batches_seen": first_step.steps,
            "total_steps": int(trainer.estimated_stepping_batches), "batch_size_per_process": BATCH_SIZE,
            "val_loss": module.val_loss, "val_accuracy": module.val_accuracy,
            "first_step_time": first_step.time, "end_time": time.time(), "torch_threads": torch.get_num_threads(),
            "backend": backend, "lightning_version": L.__version__,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
