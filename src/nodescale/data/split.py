"""Seeded train/validation split of a dataset that ships without a test split.

Every rank computes the split itself instead of receiving it, so it must come
out identical on every rank and every machine: it is drawn from a CPU
``torch.Generator`` seeded with the run's seed, whose ``randperm`` does not
depend on the host, the device or the number of threads.
"""

from __future__ import annotations

import torch

from nodescale.errors import UserError


def seeded_split(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the training and validation parts of ``n`` samples, as int64 tensors.

    About ``val_fraction`` of the samples go to validation, and each part gets at
    least one. Both index lists are sorted, so reads from files stay mostly
    sequential; the sampler shuffles anyway.
    """
    if not 0.0 < val_fraction < 1.0:
        raise UserError(
            f"val_fraction {val_fraction}",
            "must lie strictly between 0 and 1",
            "use e.g. --set data.val_fraction=0.2",
        )
    if n < 2:
        raise UserError(
            f"a dataset of {n} sample{'s' if n != 1 else ''}",
            "is too small to split into training and validation parts (each needs at least one)",
            "add samples, or give the dataset its own validation split",
        )
    n_val = min(max(round(n * val_fraction), 1), n - 1)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    order = torch.randperm(n, generator=generator)
    val, _ = order[:n_val].sort()
    train, _ = order[n_val:].sort()
    return train, val
