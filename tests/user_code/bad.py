"""Mistakes a user makes in their own model and data functions (tests/test_user_plugins.py)."""

import torch
from torch import nn
from torch.utils.data import TensorDataset


def raises(width=8):
    return helper(width)


def helper(width):
    raise ValueError("the widths do not add up")


def not_a_module():
    return nn.Linear


def one_set():
    return TensorDataset(torch.zeros(4, 64), torch.zeros(4, dtype=torch.long))


def small_images():
    train = TensorDataset(torch.zeros(8, 1, 7, 7), torch.zeros(8, dtype=torch.long))
    return train, train


def far_labels():
    train = TensorDataset(torch.zeros(8, 1, 8, 8), torch.arange(8) + 10)
    return train, train


def flat():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


def scalar_loss(output, target):
    return torch.nn.functional.cross_entropy(output, target)


class Doubler(nn.Module):
    def forward(self, x):
        return x.flatten(1)[:, :10] * 2


def no_parameters():
    return Doubler()


class Shrinking(TensorDataset):
    def __len__(self):
        return -3


def negative_length():
    data = Shrinking(torch.zeros(8, 1, 8, 8), torch.zeros(8, dtype=torch.long))
    return data, data


def interrupted():
    raise KeyboardInterrupt


def exits(code=0):
    import sys

    sys.exit(code)
