"""Step 2 of docs/tutorial.md: the same script, distributed with nodescale."""

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import nodescale


def build_dataset():
    digits = load_digits()  # 1,797 8x8 handwritten digits, shipped with scikit-learn
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, val = order[:1400], order[1400:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default="model.pt")
    args = parser.parse_args()

    ctx = nodescale.init(seed=0)  # rank, device, process group; seeds every rank alike
    device = ctx.device
    train_set, val_set = build_dataset()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = ctx.prepare(model, optimizer)  # to the device; DDP with several processes
    train_loader = ctx.loader(train_set, batch_size=args.batch_size)  # this rank's shard, per epoch
    val_loader = ctx.loader(val_set, batch_size=256, shuffle=False, pad=False)  # each sample once
    ctx.print(f"training on {device}, world size {ctx.world_size}")

    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        plain = ctx.unwrap(model)  # no DDP collectives on uneven validation shards
        plain.eval()
        hits = total = 0
        with torch.no_grad():
            for x, y in val_loader:
                hits += (plain(x.to(device)).argmax(1) == y.to(device)).sum().item()
                total += len(y)
        accuracy = ctx.sum(hits) / ctx.sum(total)  # totals over every rank
        ctx.print(f"epoch {epoch + 1}: loss {ctx.mean(loss):.4f}  val_acc {accuracy:.2%}")

    ctx.save(args.out, {"model": ctx.unwrap(model).state_dict(), "val_accuracy": accuracy,
                        "world_size": ctx.world_size})  # rank 0 writes, atomically
    del model, optimizer
    ctx.close()  # leave the process group cleanly


if __name__ == "__main__":
    main()
