"""Step 1 of docs/tutorial.md: a plain single-device training script (no nodescale yet)."""

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


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

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_set, val_set = build_dataset()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model = model.to(device)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=256, shuffle=False)
    print(f"training on {device}")

    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        plain = model
        plain.eval()
        hits = total = 0
        with torch.no_grad():
            for x, y in val_loader:
                hits += (plain(x.to(device)).argmax(1) == y.to(device)).sum().item()
                total += len(y)
        accuracy = hits / total
        print(f"epoch {epoch + 1}: loss {loss.item():.4f}  val_acc {accuracy:.2%}")

    torch.save({"model": model.state_dict(), "val_accuracy": accuracy}, args.out)


if __name__ == "__main__":
    main()
