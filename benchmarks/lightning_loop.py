"""``raw_ddp.py``'s timing job as a PyTorch Lightning script: the ``lightning`` side of ``overhead.py``.

Started as a plain script, as Lightning's documentation starts a job on one machine;
``strategy="ddp"`` starts the other processes itself (it runs this script again with
``LOCAL_RANK`` set)::

    OMP_NUM_THREADS=1 python benchmarks/lightning_loop.py --nproc 2 --model cnn --dataset synthetic \\
        --image-size 28 --channels 1 --samples 60000 --batch-size 64 --steps 300 --warmup-steps 10 \\
        --optimizer sgd --lr 0.01 --momentum 0

It takes ``raw_ddp.py``'s flags (``raw_parts.py``) and ``--nproc``, and only times: ``--steps``
is required, the learning rate is constant and nothing is validated (``raw_ddp.py``'s
``--schedule constant --no-validate``, whatever those flags say). The same model, built by the
same builder after the same seed, the same training tensors, the same optimiser, batch per
process and steps as the raw loop.

Written the way the Lightning documentation writes a script: a ``LightningModule``
(``training_step`` returning the loss and ``self.log``-ging it, ``configure_optimizers``), a
``DataLoader`` over a ``TensorDataset`` with ``shuffle=True`` (Lightning puts a
``DistributedSampler`` in: the raw loop's data order) and ``Trainer.fit`` with
``accelerator="cpu", devices=N, strategy="ddp", max_steps=steps`` (DDP over gloo) and
``logger=False, enable_checkpointing=False, enable_progress_bar=False,
enable_model_summary=False`` (no output the raw loop does not produce), no validation loader
and ``num_sanity_val_steps=0``.

Timing, as the raw loop's: a callback synchronises the device and meets the other ranks at a
barrier after the last warm-up step's ``on_train_batch_end`` (its optimiser step has returned)
and after the last step's, and counts the samples of every timed batch on every rank.

Differences from the raw loop, all the framework's idioms:

* inputs normalised once before training (the raw loop normalises every batch: two
  element-wise ops, the identity on the synthetic images);
* batches collated by the ``DataLoader`` from single samples (the raw loop indexes its tensors
  once per batch);
* DDP as Lightning's ``DDPStrategy`` sets it up: torch's defaults, so gradients are copied
  into the buckets (the raw loop sets ``gradient_as_bucket_view=True``);
* the loss stays on its rank (``self.log`` without a logger); the raw loop all-reduces and
  prints it every ``--log-every`` steps;
* Lightning's loop itself: hooks, progress tracking and the closure of automatic optimisation.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

# The script's own directory is on sys.path when it is run as a script (and so in the
# processes Lightning starts, which run it again).
from raw_parts import make_optimizer, make_parser, parse_args, sync, timing, training_tensors, write_result
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    """The benchmark's model under cross-entropy, with the side's optimiser."""

    def __init__(self, model: nn.Module, make: Any) -> None:
        super().__init__()
        self.model = model
        self.make = make  # builds the optimiser over the parameters (raw_parts.make_optimizer)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)  # kept on the rank: no logger, no sync_dist
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.make(self.parameters())


class SteadyStateClock(L.Callback):
    """The steps after the warm-up, timed between barriers, and the samples every rank trained on."""

    def __init__(self, warmup_steps: int, steps: int) -> None:
        self.warmup_steps, self.steps = warmup_steps, steps
        self.started = 0.0
        self.timed_samples = 0
        self.result: dict[str, Any] | None = None

    def meet(self, trainer: L.Trainer, pl_module: L.LightningModule) -> float:
        sync(pl_module.device)
        trainer.strategy.barrier()
        return time.perf_counter()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = self.meet(trainer, pl_module)  # replaced at the end of warm-up unless there is none

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step  # optimiser steps done, this batch's included
        if step > self.warmup_steps:
            self.timed_samples += len(batch[1])
        if step == self.warmup_steps:
            self.started = self.meet(trainer, pl_module)
        if step == self.steps:
            # Every rank, while the process group is certainly up: timing() all-reduces.
            elapsed = self.meet(trainer, pl_module) - self.started
            self.result = timing(elapsed, self.timed_samples, self.steps - self.warmup_steps, pl_module.device)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes (Lightning's devices; default 2)")
    args = parse_args(argv, parser, need_steps=True)
    model, x_train, y_train = training_tensors(args)
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size, shuffle=True)
    module = Classifier(model, lambda params: make_optimizer(args, params, torch.device("cpu")))
    clock = SteadyStateClock(args.warmup_steps, args.steps)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.nproc, strategy="ddp", max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[clock],
    )
    trainer.fit(module, loader)
    if trainer.is_global_zero:
        if clock.result is None:
            raise SystemExit(f"lightning stopped at step {trainer.global_step} of {args.steps}")
        write_result(args.json_out, {
            "side": "lightning", "model": args.model, "dataset": args.dataset, "world_size": trainer.world_size,
            "batch_size_per_process": args.batch_size, "steps": trainer.global_step,
            "timing_warmup_steps": args.warmup_steps, **clock.result, "optimizer": args.optimizer, "lr": args.lr,
            "torch_threads": torch.get_num_threads(), "backend": getattr(trainer.strategy, "process_group_backend",
                                                                         None),
            "lightning_version": L.__version__,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
