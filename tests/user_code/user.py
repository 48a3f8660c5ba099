"""A user's own model, dataset and loss, as tests/test_user_plugins.py trains them (FILE.py:FN)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.linear(x))


class Net(nn.Module):  # no block_types: its FSDP units are the items of its ModuleList
    def __init__(self, width, depth):
        super().__init__()
        self.stem = nn.Linear(64, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        x = self.stem(x.flatten(1))
        for block in self.blocks:
            x = block(x)
        return {"logits": self.head(x)}  # Hugging Face style


def build(width=16, depth=2):
    return Net(width, depth)


def digits(seed):
    from nodescale.config.schema import DataSection
    from nodescale.data.digits import FORMAT

    splits = FORMAT.load(DataSection(), seed)  # the digits nodescale embeds, as plain TensorDatasets

    def plain(part):
        inputs, labels = zip(*(part[i] for i in range(len(part))), strict=True)
        return TensorDataset(torch.stack(inputs), torch.stack(labels))

    return plain(splits.train), plain(splits.val)


def xent(output, target):
    return F.cross_entropy(output, target, reduction="none")
