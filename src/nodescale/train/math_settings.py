"""Process-wide math settings of the accelerator: cuDNN autotuning and TF32.

Set once per worker, after the device is known and before the model is built.
On any device but CUDA nothing is touched.

TF32 is set through ``torch.set_float32_matmul_precision`` (matmuls) and
``torch.backends.cudnn.allow_tf32`` (convolutions), documented and warning-free
from torch 2.6 to 2.13. The ``fp32_precision`` attributes that torch 2.9 added
are not used: they are missing before 2.9, and once set, reading the older
flags raises ``RuntimeError`` ("mix of the legacy and new APIs"), which
torch.compile's own code and other libraries still do. Setting the older flags
keeps both kinds of reading consistent.
"""

from __future__ import annotations

import torch

from nodescale.config.schema import TrainSection


def configure_math(train: TrainSection, device: torch.device) -> None:
    """Apply ``train.cudnn_benchmark`` and ``train.tf32`` when ``device`` is a CUDA device."""
    if device.type != "cuda":
        return
    # Batches have one shape per run (plans pad the last one), so the algorithm search pays off.
    torch.backends.cudnn.benchmark = train.cudnn_benchmark
    if train.tf32 is None:  # torch's defaults: fp32 matmuls, TF32 convolutions
        return
    torch.set_float32_matmul_precision("high" if train.tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = train.tf32
