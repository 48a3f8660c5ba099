"""The ``data:`` section of a run's configuration (validated without importing torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from nodescale.data.registry import DATASETS
from nodescale.errors import UserError
from nodescale.section import Section, known_or_plugin


class DataSection(Section):
    name: str = Field(
        "digits", description="dataset: a built-in one (see `nodescale datasets`), or your function that returns "
        "(train, val) datasets of (input, target), FILE.py:FUNCTION or package.module:FUNCTION"
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of your dataset function, e.g. --set data.args.root=/x"
    )
    dir: Path | None = Field(None, description="directory (or file, for hdf5) holding the dataset")
    val_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="share held out for validation when the dataset has no test split"
    )
    num_workers: int | None = Field(
        None, ge=0, description="DataLoader worker processes per rank for datasets read from files; default: the "
        "CPUs of the rank's binding (shared among the node's ranks that overlap) less one, at most 16"
    )
    decode: Literal["cpu", "gpu"] = Field(
        "cpu", description="imagefolder/shards: decode JPEGs in the DataLoader workers (cpu) or on the rank's GPU "
        "through torchvision (gpu)"
    )
    augment: bool = Field(
        False, description="image datasets: a seeded random resized crop and horizontal flip per training sample "
        "(on the device for in-memory and GPU-decoded batches, in the workers otherwise)"
    )
    samples: int = Field(2048, ge=1, description="synthetic/regression: number of training samples")
    image_size: int | None = Field(
        None, ge=1, description="synthetic: side of the square images; imagefolder: centre-crop and resize to this side"
    )
    channels: int = Field(3, ge=1, description="synthetic: image channels")
    num_classes: int = Field(10, ge=1, description="synthetic: number of classes")
    tokenizer: Path | None = Field(
        None, description="text/jsonl/hf_dataset: the Hugging Face tokenizer.json (or a directory holding it)"
    )
    text_key: str = Field("text", min_length=1, description="jsonl/hf_dataset: the key or column holding the text")
    text_unit: Literal["paragraph", "file"] = Field(
        "paragraph", description="text: one document per paragraph (between blank lines) or per file"
    )
    eos_token: str | None = Field(
        None, min_length=1, description="text/jsonl/hf_dataset: the token after each document; default: the"
        " tokenizer's own (<|endoftext|>, </s>, ...)"
    )
    val_dir: Path | None = Field(
        None, description="text/jsonl: validation documents of their own (a file or directory); shards: "
        "validation shards (a directory, glob or brace list); default: data.val_fraction of the samples"
    )
    seq_len: int | None = Field(
        None, ge=1, description="language models: tokens per sample, the context trained on (windows of "
        "seq_len+1 tokens at stride seq_len); default: the dataset's (pydoc 64 bytes, tokens 1024, text formats 256)"
    )
    token_dtype: Literal["uint16", "uint32"] = Field("uint16", description="tokens: the integer type of train.bin "
                                                     "and val.bin")
    vocab_size: int | None = Field(
        None, ge=1, description="tokens: the vocabulary size; default: vocab_size in DIR/meta.json, else GPT-2's "
        "50257 for uint16"
    )
    inputs: list[str] = Field(default_factory=list, description="zarr: the input variables, e.g. t2m,u10")
    targets: list[str] = Field(default_factory=list, description="zarr: the variables predicted, e.g. tp")
    window: dict[str, int] = Field(
        default_factory=dict, description="zarr: a sample's size along named dimensions, e.g. time:4,lat:32,lon:32 "
        "(dimensions not named are taken whole)"
    )
    stride: dict[str, int] = Field(
        default_factory=dict, description="zarr: the step between windows along named dimensions, e.g. time:1; "
        "default: the window's size (no overlap)"
    )

    @field_validator("inputs", "targets", mode="before")
    @classmethod
    def _names(cls, value: object) -> object:
        return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value

    @field_validator("window", "stride", mode="before")
    @classmethod
    def _sizes(cls, value: object) -> object:
        """``time:4,lat:32`` (the form --set reads best) as the mapping a config file writes."""
        if not isinstance(value, str):
            return value
        sizes = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            dim, sep, size = part.partition(":")
            if not sep or not dim.strip() or not size.strip().isdigit() or int(size) < 1:
                raise UserError(f"data window or stride {value!r}", "must be DIMENSION:SIZE pairs, comma-separated, "
                                "each size a whole number of at least 1", "e.g. --set data.window=time:4,lat:32,lon:32")
            sizes[dim.strip()] = int(size)
        return sizes

    @field_validator("window", "stride")
    @classmethod
    def _positive(cls, value: dict[str, int]) -> dict[str, int]:
        if any(size < 1 for size in value.values()):
            raise UserError(f"data window or stride {value}", "sizes must be at least 1", "e.g. time:4,lat:32")
        return value

    normalise: Literal["none", "train"] = Field(
        "none", description="zarr: standardise each variable by its mean and std over the training split (train, "
        "computed once per node a slab of chunks at a time, cached) or not (none)"
    )
    stats: dict[str, tuple[float, float]] = Field(
        default_factory=dict, description="zarr: a variable's mean and std given, e.g. t2m:278.5:21.3,tp:0.4:1.1 "
        "(used instead of computing them; with data.normalise=train)"
    )

    @field_validator("stats", mode="before")
    @classmethod
    def _stats(cls, value: object) -> object:
        """``t2m:278.5:21.3,tp:0:1`` (the form --set reads best) as the mapping a config file writes."""
        if not isinstance(value, str):
            return value
        stats = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            name, *figures = (f.strip() for f in part.split(":"))
            try:
                mean, std = (float(f) for f in figures)
            except ValueError:
                raise UserError(f"data.stats {part!r}", "must be VARIABLE:MEAN:STD, comma-separated",
                                "e.g. --set data.stats=t2m:278.5:21.3,tp:0.4:1.1") from None
            stats[name] = (mean, std)
        return stats

    @field_validator("stats")
    @classmethod
    def _positive_std(cls, value: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        for name, (mean, std) in value.items():
            if not (std > 0 and abs(mean) < float("inf") and std < float("inf")):
                raise UserError(f"data.stats {name}:{mean}:{std}", "needs a finite mean and a positive, finite std",
                                "give each variable's mean and standard deviation")
        return value

    order: Literal["shuffled", "sequential"] = Field(
        "shuffled", description="training order: a new seeded order each epoch, or the stored order (for tests "
        "and equality checks)"
    )
    skip_bad_samples: bool = Field(
        False, description="shards: train on without the samples of a corrupt or truncated shard (weight 0, with "
        "a warning) instead of stopping"
    )
    stage: Path | None = Field(
        None, description="shards: copy each rank's shards to this node-local directory before the first epoch"
    )

    @field_validator("name")
    @classmethod
    def _known_dataset(cls, value: str) -> str:
        return known_or_plugin("dataset", value, DATASETS)

    @model_validator(mode="before")
    @classmethod
    def _dataset_seq_len(cls, values: Any) -> Any:
        """A language-model dataset's own default sequence length, written into the resolved configuration."""
        if isinstance(values, dict) and values.get("seq_len") is None:
            entry = DATASETS.get(str(values.get("name", cls.model_fields["name"].default)))
            if entry is not None and entry.seq_len is not None:
                return {**values, "seq_len": entry.seq_len}
        return values
