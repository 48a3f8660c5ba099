"""The trainer's input pipeline: workers per rank, where images are decoded and where they are augmented.

* ``data.num_workers`` unset: the cores of the rank's binding (``nodescale.data.workers``); none
  for in-memory arrays, which are cut a whole batch at a time.
* ``data.decode=gpu``: workers read bytes, the rank decodes each batch on its GPU
  (``nodescale.data.gpu_decode``); only for datasets of image files (imagefolder, shards).
* ``data.augment``: on the device for in-memory arrays and GPU-decoded batches, in the workers
  (``AugmentedDataset``) for CPU-decoded ones. Validation is never augmented.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import Dataset, TensorDataset

from nodescale.data.arrays import WholeBatchDataset
from nodescale.data.augment import Augment, AugmentedDataset
from nodescale.data.workers import workers_for_rank
from nodescale.errors import UserError

if TYPE_CHECKING:
    from nodescale.data.base import DatasetSplits
    from nodescale.data.section import DataSection
    from nodescale.distributed.process_group import Runtime


@dataclass
class Pipeline:
    """The datasets to load from and the options of ``ctx.loader`` for each."""

    train: Dataset
    val: Dataset
    workers: int
    train_options: dict[str, Any] = field(default_factory=dict)
    val_options: dict[str, Any] = field(default_factory=dict)


def input_pipeline(cfg: DataSection, splits: DatasetSplits, runtime: Runtime, seed: int) -> Pipeline:
    """Every rank calls it (the default worker count is agreed by a collective)."""
    train, val = splits.train, splits.val
    in_memory = isinstance(train, (WholeBatchDataset, TensorDataset))  # cut a batch at a time: nothing to decode
    workers = cfg.num_workers if cfg.num_workers is not None else 0 if in_memory else workers_for_rank(runtime)
    if cfg.augment and not splits.spec.is_image:
        raise UserError(f"--augment on dataset {cfg.name!r}", f"crops and flips images, but its samples have "
                        f"shape {tuple(splits.spec.shape)}", "leave --augment out for this dataset")
    pipeline = Pipeline(train, val, workers)
    augment = Augment(seed) if cfg.augment else None
    if cfg.decode == "gpu":
        _decode_on_gpu(pipeline, cfg, splits, runtime)
        pipeline.train_options["augment"] = augment
    elif augment is not None and isinstance(train, WholeBatchDataset):
        pipeline.train_options["augment"] = augment  # cut on the device: augmented there, a batch at a time
    elif augment is not None:
        pipeline.train = AugmentedDataset(train, augment)
    return pipeline


def _decode_on_gpu(pipeline: Pipeline, cfg: DataSection, splits: DatasetSplits, runtime: Runtime) -> None:
    from nodescale.data.gpu_decode import EncodedDataset, GpuDecoder, collate_encoded
    from nodescale.data.tar_index import DATA_EXTENSIONS, IMAGE_EXTENSIONS

    train = splits.train
    if not hasattr(train, "encoded"):
        raise UserError(f"--decode gpu on dataset {cfg.name!r}", "decodes image files, and this dataset's samples "
                        "are not read from image files", "use --decode cpu, or --dataset imagefolder or shards")
    columns = getattr(train, "columns", None)  # shards: every sample must be an image
    if columns is not None:
        exts = {DATA_EXTENSIONS[int(e)] for e in np.unique(columns["ext"]) if e >= 0}
        if not exts <= set(IMAGE_EXTENSIONS):
            raise UserError(f"--decode gpu on shards {cfg.dir}", f"decodes images, and the shards hold "
                            f".{', .'.join(sorted(exts - set(IMAGE_EXTENSIONS)))} samples", "use --decode cpu")
    decoder = GpuDecoder(runtime.device, cfg.image_size, tuple(splits.spec.shape))
    pipeline.train, pipeline.val = EncodedDataset(splits.train), EncodedDataset(splits.val)
    for options in (pipeline.train_options, pipeline.val_options):
        options.update(decode=decoder, collate_fn=collate_encoded)
