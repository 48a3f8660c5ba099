"""The PyTorch MNIST example on scikit-learn's digits, distributed with nodescale.

Upstream: pytorch/examples, mnist/main.py (two convolutions, Adadelta, StepLR, nll_loss). Same
model shape, optimiser, schedule, loss and loop; the data are the 1,797 8x8 digits of
``sklearn.datasets.load_digits`` (no download), so the net is sized for 8x8 inputs.
``main_single.py`` is one process; ``main_distributed.py`` is it with nodescale's calls.

    python examples/mnist/main_distributed.py --epochs 3 --save-model   # also: torchrun, srun, mpiexec
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from sklearn.datasets import load_digits
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import TensorDataset

import nodescale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)  # 8x8 -> 6x6
        self.conv2 = nn.Conv2d(32, 64, 3, 1)  # 6x6 -> 4x4, pooled to 2x2
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64 * 2 * 2, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)


def digits(test_size=360):
    """Train and test splits of the digits as 1x8x8 images, normalised like MNIST's loaders do."""
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = (images - images.mean()) / images.std()
    labels = torch.tensor(data.target, dtype=torch.int64)
    # A fixed generator, not the training seed: the test split is the same whatever --seed says.
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, test = order[test_size:], order[:test_size]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def train(args, ctx, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        ctx.backward(loss)  # scaled so that the step gets the mean over every rank's samples
        ctx.step(optimizer)
        if batch_idx % args.log_interval == 0:
            ctx.print(f"Train Epoch: {epoch} [{batch_idx}/{len(train_loader)} batches]\tLoss: {loss.item():.6f}")
            if args.dry_run:
                break


def test(ctx, model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    seen = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += (output.argmax(dim=1) == target).sum().item()
            seen += test_loader.real_count
    # Each rank saw only its shard: the totals are sums over ranks.
    test_loss, correct, seen = ctx.sum(test_loss), ctx.sum(correct), ctx.sum(seen)
    test_loss /= seen
    ctx.print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct:.0f}/{seen:.0f} "
          f"({100.0 * correct / seen:.0f}%)\n")


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example, on scikit-learn's digits")
    parser.add_argument("--batch-size", type=int, default=64, help="input batch size for training (default: 64)")
    parser.add_argument("--test-batch-size", type=int, default=1000,
                        help="input batch size for testing (default: 1000)")
    parser.add_argument("--epochs", type=int, default=14, help="number of epochs to train (default: 14)")
    parser.add_argument("--lr", type=float, default=1.0, help="learning rate (default: 1.0)")
    parser.add_argument("--gamma", type=float, default=0.7, help="learning rate step gamma (default: 0.7)")
    parser.add_argument("--dry-run", action="store_true", help="quickly check a single pass")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default: 1)")
    parser.add_argument("--log-interval", type=int, default=10, help="batches between training logs")
    parser.add_argument("--save-model", action="store_true", help="save the model as mnist_cnn.pt")
    args = parser.parse_args()

    ctx = nodescale.init(seed=args.seed)  # joins the job, whatever started it; one process alone works too
    device = ctx.device
    train_set, test_set = digits()
    train_loader = ctx.loader(train_set, batch_size=args.batch_size)  # per process
    test_loader = ctx.loader(test_set, batch_size=args.test_batch_size, shuffle=False, pad=False)

    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    model, optimizer = ctx.prepare(model, optimizer)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, ctx, model, device, train_loader, optimizer, epoch)
        test(ctx, ctx.unwrap(model), device, test_loader)  # shards may differ in size: no DDP collectives
        scheduler.step()

    if args.save_model:
        ctx.save("mnist_cnn.pt", ctx.unwrap(model).state_dict())  # rank 0 writes, every rank waits
    ctx.close()


if __name__ == "__main__":
    main()
