"""Dataset formats by name, without importing torch.

Each entry names the module holding the format's ``FORMAT`` object (see
``nodescale.data.base.DatasetFormat``) and what it needs, so configurations are
validated before torch loads. Adding a format is one file plus one line here.
A name ``FILE.py:FUNCTION`` (or ``package.module:FUNCTION``) is the user's own
dataset function instead (``nodescale.data.user_dataset``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from nodescale.errors import unknown_choice

if TYPE_CHECKING:
    from nodescale.data.base import DatasetFormat


@dataclass(frozen=True)
class DatasetEntry:
    """Where a format lives, what task it serves and what files it expects."""

    module: str
    task: Literal["classification", "regression", "language_modeling", "any"]
    needs_dir: bool
    layout: str  # what --data-dir must point at, for error hints
    description: str
    seq_len: int | None = None  # a language-model dataset's default data.seq_len
    epochs: int | None = None  # its default train.epochs, where the global 10 would run long

    def load_format(self) -> DatasetFormat:
        return importlib.import_module(self.module).FORMAT


DATASETS: dict[str, DatasetEntry] = {
    "digits": DatasetEntry(
        "nodescale.data.digits", "classification", False, "no files needed",
        "the 1,797 8x8 handwritten digits that scikit-learn ships",
    ),
    "mnist": DatasetEntry(
        "nodescale.data.mnist", "classification", True,
        "a directory with train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-* likewise",
        "MNIST from its IDX files, raw or gzipped",
    ),
    "cifar10": DatasetEntry(
        "nodescale.data.cifar10", "classification", True,
        "the cifar-10-batches-py directory with data_batch_1..5 and test_batch",
        "CIFAR-10 from its python pickle batches",
    ),
    "imagefolder": DatasetEntry(
        "nodescale.data.imagefolder", "classification", True,
        "a directory with one sub-directory of images per class, or train/ and val/ each laid out so",
        "images in one directory per class",
    ),
    "hdf5": DatasetEntry(
        "nodescale.data.hdf5", "classification", True,
        "an .h5 file with images and labels datasets at the top (LUMI's layout, split by val_fraction), "
        "or train/ and val/ (or test/) groups holding them",
        "images and labels in an HDF5 file (like LUMI's Tiny-ImageNet)",
    ),
    "shards": DatasetEntry("nodescale.data.shards", "classification", True, "a directory of train-NNNNNN.tar (and "
                           "val-NNNNNN.tar) shards, or a glob or brace list of .tar files", "WebDataset-style tar "
                           "shards (KEY.jpg/.png/.npy + KEY.cls or KEY.json), each rank reading its own"),
    "synthetic": DatasetEntry(
        "nodescale.data.synthetic", "classification", False, "no files needed",
        "random images drawn from the seed and kept on the device, for benchmarks",
    ),
    "regression": DatasetEntry(
        "nodescale.data.regression", "regression", False, "no files needed",
        "random 20-feature vectors with a noisy linear target (for the toy model)",
    ),
    "text": DatasetEntry(
        "nodescale.data.text", "language_modeling", True,
        "a .txt file, or a directory of them (data.tokenizer: tokenizer.json)",
        "UTF-8 text, one document per paragraph, tokenised once into cached token files", seq_len=256
    ),
    "jsonl": DatasetEntry(
        "nodescale.data.jsonl", "language_modeling", True,
        "a .jsonl file, or a directory of them, one {\"text\": ...} object a line (data.tokenizer: tokenizer.json)",
        "JSON Lines documents, tokenised once into cached token files", seq_len=256
    ),
    "hf_dataset": DatasetEntry(
        "nodescale.data.hf_dataset", "language_modeling", True,
        "the directory datasets' save_to_disk wrote, with a text column (data.tokenizer: tokenizer.json)",
        "a Hugging Face dataset saved to disk, tokenised once into cached token files", seq_len=256
    ),
    "pydoc": DatasetEntry(
        "nodescale.data.pydoc", "language_modeling", False, "no files needed",
        "the bytes of Python's help topics (pydoc_data), for language models", seq_len=64,
        epochs=3,  # 10 would take 5 minutes on 2 CPU cores; 3 end near 2.2 nats per byte in under 2
    ),
    "tokens": DatasetEntry(
        "nodescale.data.tokens", "language_modeling", True,
        "a directory with train.bin and val.bin (flat uint16 or uint32 token ids, nanoGPT's format)",
        "nanoGPT-style token files, memory-mapped, for language models", seq_len=1024,
    ),
    "zarr": DatasetEntry(
        "nodescale.data.gridded", "regression", True,
        "a Zarr store or netCDF file; data.inputs, data.targets: variable names; data.window: e.g. time:4,lat:32",
        "windows of named variables of a Zarr store or netCDF file, read chunk by chunk (climate, weather)",
    ),
}


def get_format(name: str) -> DatasetFormat:
    """The format object registered under ``name``, or the user's dataset function (``FILE.py:FN``)."""
    if ":" in name:
        from nodescale.data.user_dataset import PluginFormat

        return PluginFormat(name)
    if name not in DATASETS:
        raise unknown_choice("dataset", name, DATASETS)
    return DATASETS[name].load_format()
