"""Your own model and training loop, made distributed with five nodescale calls.

Run it as you would any script; nodescale finds out how it was started:

    python examples/train_own_model.py                      # one process
    torchrun --nproc-per-node 2 examples/train_own_model.py # 2 processes
    srun python examples/train_own_model.py                 # one process per Slurm task

It fits a small MLP to the handwritten digits scikit-learn ships and writes
``own-model.pt`` (from rank 0 only) with the weights and the final accuracy.
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import nodescale


def build_dataset() -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    # A fixed generator: every rank must hold out the same samples.
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, val = order[:1400], order[1400:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--out", default="own-model.pt")
    args = parser.parse_args()

    ctx = nodescale.init(seed=0)  # 1: join the job, pick this rank's device
    train_set, val_set = build_dataset()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = ctx.prepare(model, optimizer)  # 2: device + DDP
    train_loader = ctx.loader(train_set, batch_size=args.batch_size)  # 3: sharded, reshuffled per epoch
    # pad=False: every validation sample on exactly one rank, counted once.
    val_loader = ctx.loader(val_set, batch_size=256, shuffle=False, pad=False)

    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            x, y = x.to(ctx.device), y.to(ctx.device)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        plain = ctx.unwrap(model)  # shards may differ by one sample: no DDP collectives here
        plain.eval()
        hits = total = 0
        with torch.no_grad():
            for x, y in val_loader:
                hits += (plain(x.to(ctx.device)).argmax(1) == y.to(ctx.device)).sum().item()
                total += len(y)
        # 4: totals over every rank (the validation shards differ per rank).
        accuracy = ctx.sum(hits) / ctx.sum(total)
        ctx.print(f"epoch {epoch + 1}: loss {ctx.mean(loss):.4f}  val_acc {accuracy:.2%}")

    ctx.save(args.out, {"model": ctx.unwrap(model).state_dict(), "val_accuracy": accuracy,
                        "val_samples": int(ctx.sum(total)), "world_size": ctx.world_size})
    del model, optimizer
    ctx.close()  # 5: leave the process group cleanly


if __name__ == "__main__":
    main()
