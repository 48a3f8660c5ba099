"""A user's training script on nodescale's library API, driven by the tests in tests/test_engine_api.py.

Trains an MLP on fixed random data with SGD; can save a checkpoint at a step, resume, stop
on a signal, and writes its final weights and evaluation to OUT/result.pt from rank 0.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import nodescale


def datasets(train_size: int) -> tuple[TensorDataset, TensorDataset]:
    generator = torch.Generator().manual_seed(0)  # every rank holds the same samples
    x = torch.randn(train_size + 97, 10, generator=generator)
    y = (x[:, :3].argmax(1) + (x[:, 3] > 1).long()) % 3
    return TensorDataset(x[:train_size], y[:train_size]), TensorDataset(x[train_size:], y[train_size:])


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag, kind, default in (("--strategy", str, "auto"), ("--batch-size", int, 8), ("--grad-accum", int, 1),
                                ("--epochs", int, 2), ("--train-size", int, 301), ("--save-at", int, 0),
                                ("--sleep", float, 0.0), ("--precision", str, "fp32"), ("--stall-at", int, 0),
                                ("--heartbeat", float, 300.0), ("--clip", float, 0.0)):
        parser.add_argument(flag, type=kind, default=default)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    ctx = nodescale.init(strategy=args.strategy, precision=args.precision, seed=0, out=args.out,
                         grad_accum=args.grad_accum, heartbeat_timeout_s=args.heartbeat)
    train_set, val_set = datasets(args.train_size)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ctx.prepare(model, optimizer)
    loader = ctx.loader(train_set, batch_size=args.batch_size)
    val_loader = ctx.loader(val_set, batch_size=16, shuffle=False)
    if args.resume:
        ctx.load_checkpoint({"model": model, "optimizer": optimizer, "loader": loader})
    largest_norm = 0.0  # the largest gradient norm before clipping (None from DeepSpeed, whose engine clips)
    while loader.epoch < args.epochs:
        for x, y in loader:
            with ctx.autocast():
                loss = F.cross_entropy(model(x), y)
            ctx.backward(loss)
            norm = ctx.clip_grad_norm(model, args.clip) if args.clip else None
            largest_norm = max(largest_norm, float(norm) if norm is not None else 0.0)
            if ctx.step(optimizer):
                if ctx.global_step == args.save_at:
                    ctx.save_checkpoint({"model": model, "optimizer": optimizer, "loader": loader})
                ctx.log({"loss": loss})
                if ctx.should_stop():
                    ctx.save_checkpoint({"model": model, "optimizer": optimizer, "loader": loader})
                    ctx.exit_for_requeue()
                time.sleep(args.sleep)
                if ctx.global_step == args.stall_at and ctx.rank == 1:
                    time.sleep(120)  # alive, heartbeat thread running, but no step: the watchdog must say so
    # Evaluation with every rank taking part (FSDP's forward is a collective): count real samples only.
    model.eval()
    hits = total = 0
    with torch.no_grad():
        for x, y in val_loader:
            real = val_loader.real_count
            hits += int((model(x).argmax(1)[:real] == y[:real]).sum())
            total += real
    accuracy = ctx.sum(hits) / ctx.sum(total)
    ctx.log({"val_accuracy": accuracy})
    state = {name: tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
             for name, tensor in ctx.unwrap(model).state_dict().items()}  # every rank gathers FSDP's shards
    ctx.save(f"{args.out}/result.pt", {"weights": state, "val_samples": int(ctx.sum(total)),
                                       "val_accuracy": accuracy, "steps": ctx.global_step,
                                       "largest_norm": largest_norm})
    del model, optimizer
    ctx.close()


if __name__ == "__main__":
    main()
