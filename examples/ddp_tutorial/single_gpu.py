"""The PyTorch DDP tutorial series' starting point on scikit-learn's digits, in one process.

Upstream: pytorch/examples, distributed/ddp-tutorial-series/single_gpu.py (a ``Trainer`` with
``_run_batch``, ``_run_epoch``, ``_save_checkpoint`` and ``train``; a linear model and SGD). Same
loop shape; the data are the 1,797 8x8 digits of ``sklearn.datasets.load_digits`` (64 features,
10 classes) instead of random pairs, with a held-out split to measure accuracy on.
``single_gpu.py`` is one process; ``nodescale_gpu.py`` is it with nodescale's calls.

    python examples/ddp_tutorial/single_gpu.py 5 1 --batch_size 32
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


class Trainer:
    def __init__(self, model, train_data, test_data, optimizer, device, save_every):
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.test_data = test_data
        self.optimizer = optimizer
        self.save_every = save_every

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[{self.device}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            self._run_batch(source, targets)

    def _run_test(self, epoch):
        model = self.model
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for source, targets in self.test_data:
                source, targets = source.to(self.device), targets.to(self.device)
                correct += (model(source).argmax(dim=1) == targets).sum().item()
                total += len(targets)
        model.train()
        print(f"Epoch {epoch} | Test accuracy: {correct:.0f}/{total:.0f} ({correct / total:.1%})")

    def _save_checkpoint(self, epoch):
        ckp = self.model.state_dict()
        path = "checkpoint.pt"
        torch.save(ckp, path)
        print(f"Epoch {epoch} | Training checkpoint saved at {path}")

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


def prepare_dataloader(dataset, batch_size, shuffle=True):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(), shuffle=shuffle)


def main(total_epochs, save_every, batch_size):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_set, test_set, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(train_set, batch_size)
    test_data = prepare_dataloader(test_set, 1000, shuffle=False)
    trainer = Trainer(model, train_data, test_data, optimizer, device, save_every)
    trainer.train(total_epochs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    args = parser.parse_args()
    torch.manual_seed(0)
    main(args.total_epochs, args.save_every, args.batch_size)
