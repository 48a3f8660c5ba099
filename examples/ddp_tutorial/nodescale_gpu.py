"""The PyTorch DDP tutorial series' starting point on scikit-learn's digits, distributed with nodescale.

Upstream: pytorch/examples, distributed/ddp-tutorial-series/single_gpu.py (a ``Trainer`` with
``_run_batch``, ``_run_epoch``, ``_save_checkpoint`` and ``train``; a linear model and SGD). Same
loop shape; the data are the 1,797 8x8 digits of ``sklearn.datasets.load_digits`` (64 features,
10 classes) instead of random pairs, with a held-out split to measure accuracy on.
``single_gpu.py`` is one process; ``nodescale_gpu.py`` is it with nodescale's calls.

    python examples/ddp_tutorial/nodescale_gpu.py 5 1 --batch_size 32   # also: torchrun, srun, mpiexec
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

import nodescale


class Trainer:
    def __init__(self, ctx, model, train_data, test_data, optimizer, device, save_every):
        self.ctx = ctx
        self.device = device
        self.model, self.optimizer = ctx.prepare(model, optimizer)  # on this rank's device, in DDP
        self.train_data = train_data
        self.test_data = test_data
        self.save_every = save_every

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        self.ctx.backward(loss)
        self.ctx.step(self.optimizer)

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        self.ctx.print(f"[{self.device}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            self._run_batch(source, targets)

    def _run_test(self, epoch):
        model = self.ctx.unwrap(self.model)  # test shards may differ in size: no DDP collectives
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for source, targets in self.test_data:
                source, targets = source.to(self.device), targets.to(self.device)
                correct += (model(source).argmax(dim=1) == targets).sum().item()
                total += self.test_data.real_count
        model.train()
        correct, total = self.ctx.sum(correct), self.ctx.sum(total)  # each rank tested only its shard
        self.ctx.print(f"Epoch {epoch} | Test accuracy: {correct:.0f}/{total:.0f} ({correct / total:.1%})")

    def _save_checkpoint(self, epoch):
        ckp = {"model": self.model, "optimizer": self.optimizer, "epoch": epoch}
        path = self.ctx.save_checkpoint(ckp)  # every rank calls it; one file, written by rank 0
        self.ctx.print(f"Epoch {epoch} | Training checkpoint saved at {path}")

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            self._run_test(epoch)
            if epoch % self.save_every == 0:
                self._save_checkpoint(epoch)


def load_train_objs():
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    # A fixed generator: the test split is the same in every run (and on every rank).
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train_set, test_set = TensorDataset(x[order[360:]], y[order[360:]]), TensorDataset(x[order[:360]], y[order[:360]])
    model = torch.nn.Linear(64, 10)
    # Upstream's lr=1e-3 suits its random regression pairs; digits need more to learn in a few epochs.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    return train_set, test_set, model, optimizer


def prepare_dataloader(ctx, dataset, batch_size, shuffle=True):
    # The test loader (shuffle=False) is not padded: every test sample on exactly one rank.
    return ctx.loader(dataset, batch_size=batch_size, shuffle=shuffle, pad=shuffle)


def main(total_epochs, save_every, batch_size):
    ctx = nodescale.init(out="ddp_run")  # checkpoints go to ddp_run/checkpoints/
    device = ctx.device
    train_set, test_set, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(ctx, train_set, batch_size)
    test_data = prepare_dataloader(ctx, test_set, 1000, shuffle=False)
    trainer = Trainer(ctx, model, train_data, test_data, optimizer, device, save_every)
    trainer.train(total_epochs)
    ctx.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    args = parser.parse_args()
    torch.manual_seed(0)
    main(args.total_epochs, args.save_every, args.batch_size)
