"""A Hugging Face dataset saved with ``save_to_disk``, tokenised into cached token files.

``--data-dir`` is the directory ``Dataset.save_to_disk`` or
``DatasetDict.save_to_disk`` wrote. Each row is one document, its text in the
column ``data.text_key`` (default ``text``). A ``DatasetDict`` gives its
``train`` split, and its ``validation`` (or ``val``, ``valid``, ``test``) split
when it has one; otherwise ``data.val_fraction`` of the rows are held out.
``datasets`` is optional (the ``lm`` extra) and imported only when used.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodescale.data.token_cache import Document, Split
from nodescale.data.tokenised_format import TokenisedFormat, data_path
from nodescale.data.tokenizer_file import require
from nodescale.errors import UserError

if TYPE_CHECKING:
    from nodescale.data.section import DataSection

VAL_SPLITS = ("validation", "val", "valid", "test")
ROWS_PER_READ = 1024


def open_splits(cfg: DataSection) -> dict[Split | None, Any]:
    """The saved dataset's parts by split (None: one set that val_fraction splits), text column checked."""
    datasets = require("datasets", "hf_dataset")
    path = data_path(cfg)
    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises FileNotFoundError, ValueError or pyarrow's errors, by damage
        raise UserError(f"--data-dir {path}", f"is not a dataset saved by datasets' save_to_disk ({err})",
                        "pass the directory that Dataset.save_to_disk or DatasetDict.save_to_disk wrote") from err
    if isinstance(saved, datasets.DatasetDict):
        if "train" not in saved:
            raise UserError(f"saved dataset {path}", f"has no 'train' split (it has {', '.join(saved)})",
                            "save a DatasetDict with a 'train' split (and a 'validation' one), or a single Dataset")
        val = next((name for name in VAL_SPLITS if name in saved), None)
        parts: dict[Split | None, Any] = (
            {None: saved["train"]} if val is None else {"train": saved["train"], "val": saved[val]}
        )
    else:
        parts = {None: saved}
    for part in parts.values():
        if cfg.text_key not in part.column_names:
            columns = ", ".join(map(repr, part.column_names))
            raise UserError(f"saved dataset {path}", f"has no column {cfg.text_key!r} (its columns: {columns})",
                            "--set data.text_key=COLUMN, the column of text")
    return parts


class SavedDatasetReader:
    """The rows of a saved dataset, read in batches from its memory-mapped Arrow files."""

    def check(self, cfg: DataSection) -> None:
        if cfg.val_dir is not None:
            raise UserError("data.val_dir with dataset 'hf_dataset'", "a saved dataset brings its own splits",
                            "save a DatasetDict with 'train' and 'validation' splits, or drop data.val_dir")
        open_splits(cfg)

    def options(self, cfg: DataSection) -> dict[str, Any]:
        return {"source": str(data_path(cfg)), "text_key": cfg.text_key}

    def inputs(self, cfg: DataSection) -> list[Path]:
        root = data_path(cfg)
        return sorted(path for path in root.rglob("*") if path.is_file())

    def documents(self, cfg: DataSection) -> Iterator[Document]:
        key = cfg.text_key
        for split, part in open_splits(cfg).items():
            row = 0
            for batch in part.select_columns([key]).iter(batch_size=ROWS_PER_READ):
                for text in batch[key]:
                    if not isinstance(text, str):
                        raise UserError(
                            f"saved dataset {data_path(cfg)}, {split or 'train'} row {row}",
                            f"holds a {type(text).__name__} in column {key!r}, not text",
                            "fill or drop the rows without text (dataset.filter), then save it again",
                        )
                    yield split, text
                    row += 1


FORMAT = TokenisedFormat("hf_dataset", SavedDatasetReader())
