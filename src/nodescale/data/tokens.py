"""nanoGPT-style token files: ``DIR/train.bin`` and ``DIR/val.bin``, flat arrays of uint16 or uint32 ids.

Documents are separated by the tokenizer's end-of-text token inside the files, as nanoGPT's
``prepare.py`` writes them; nodescale reads the ids as they are. The files are memory-mapped
(``data.token_windows``), so their size costs no memory. The vocabulary is ``data.vocab_size``,
else ``vocab_size`` in ``DIR/meta.json``, else GPT-2's 50257 for uint16 files (nanoGPT's
OpenWebText and Shakespeare preparations).

The checks run in the launcher before any process starts (torch-free) and again where the
files are loaded: each file is a whole number of tokens, holds at least one window, and a
sample of its ids (evenly spread chunks, the whole file up to a million tokens) lies below
the vocabulary size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nodescale.data.registry import DATASETS
from nodescale.errors import UserError

if TYPE_CHECKING:
    from nodescale.data.base import DatasetSplits
    from nodescale.data.section import DataSection

SPLITS = ("train.bin", "val.bin")
GPT2_VOCAB = 50257
SAMPLE_CHUNKS = 16  # chunks of SAMPLE_CHUNK tokens read to check the ids: a millisecond's read
SAMPLE_CHUNK = 65536
LAYOUT = DATASETS["tokens"].layout


def vocab_size(cfg: DataSection, root: Path) -> int:
    """``data.vocab_size``, else ``DIR/meta.json``'s ``vocab_size``, else GPT-2's for uint16 files."""
    if cfg.vocab_size is not None:
        return cfg.vocab_size
    meta = root / "meta.json"
    if meta.is_file():
        try:
            value = json.loads(meta.read_text(encoding="utf-8"))["vocab_size"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{meta}", f"has no readable vocab_size ({type(exc).__name__}: {exc})",
                            'write {"vocab_size": N} into it, or set data.vocab_size') from None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{meta}: vocab_size {value!r}", "must be a whole number of at least 1",
                            "write the tokenizer's vocabulary size, or set data.vocab_size")
        return value
    if cfg.token_dtype == "uint16":
        return GPT2_VOCAB
    raise UserError(f"{root}: uint32 tokens without a vocabulary size", "nodescale cannot guess it",
                    'set data.vocab_size (--set data.vocab_size=N), or write {"vocab_size": N} into DIR/meta.json')


def open_tokens(path: Path, dtype: str, seq_len: int, vocab: int) -> np.ndarray:
    """``path`` as a read-only memory map of ``dtype`` ids, checked: whole tokens, one window, ids in range."""
    if not path.is_file():
        raise UserError(f"{path}", "does not exist", f"--data-dir must be {LAYOUT}")
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size % itemsize:
        raise UserError(f"{path} ({size:,} bytes)", f"is not a whole number of {dtype} tokens ({itemsize} bytes each)",
                        "set data.token_dtype to the type the file was written with (nanoGPT writes uint16)")
    if size // itemsize < seq_len + 1:
        raise UserError(f"{path} ({size // itemsize:,} tokens)", f"holds no window of seq_len + 1 = {seq_len + 1} "
                        "tokens", f"use a shorter --seq-len (at most {max(1, size // itemsize - 1)}), or more data")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    check_ids(tokens, vocab, str(path))
    return tokens


def check_ids(tokens: np.ndarray, vocab: int, where: str) -> None:
    """Refuse ids at or above ``vocab`` in a sample of ``tokens`` (all of them up to SAMPLE_CHUNKS chunks)."""
    last = max(0, len(tokens) - SAMPLE_CHUNK)
    for start in sorted({int(s) for s in np.linspace(0, last, SAMPLE_CHUNKS)}):
        chunk = np.asarray(tokens[start:start + SAMPLE_CHUNK])
        if int(chunk.max()) >= vocab:
            position = int(np.argmax(chunk >= vocab))  # the first one
            raise UserError(f"token id {int(chunk[position])} at position {start + position:,} of {where}",
                            f"is at or above the vocabulary size {vocab}",
                            "set data.vocab_size to the tokenizer's vocabulary size (or data.token_dtype, if the "
                            "file holds another integer type)")


def open_splits(root: Path, cfg: DataSection, dtype: str) -> tuple[np.ndarray, np.ndarray, int]:
    """``root``'s train.bin and val.bin, checked and memory-mapped, and the vocabulary size."""
    vocab = vocab_size(cfg, root)
    train, val = (open_tokens(root / name, dtype, cfg.seq_len, vocab) for name in SPLITS)
    return train, val, vocab


def load_token_splits(directory: Path, cfg: DataSection, seed: int) -> DatasetSplits:
    """Windows over token files nodescale wrote (the text formats' cache): dtype and vocabulary from meta.json."""
    from nodescale.data.token_windows import token_splits  # imports torch: see nodescale.data.base

    del seed  # the order is the loader's
    dtype = json.loads((directory / "meta.json").read_text(encoding="utf-8"))["dtype"]
    train, val, vocab = open_splits(directory, cfg, dtype)
    return token_splits(train, val, cfg.seq_len, vocab)


class TokensFormat:
    """``DIR/train.bin`` and ``DIR/val.bin``, memory-mapped, in windows of ``data.seq_len`` + 1 tokens."""

    name = "tokens"
    needs_dir = True

    def _open(self, cfg: DataSection) -> tuple[np.ndarray, np.ndarray, int]:
        if cfg.dir is None:
            raise UserError("dataset 'tokens'", "needs the location of its files", f"pass --data-dir ({LAYOUT})")
        if not cfg.dir.is_dir():
            raise UserError(f"--data-dir {cfg.dir}", "is not a directory", f"give {LAYOUT}")
        return open_splits(cfg.dir, cfg, cfg.token_dtype)

    def check(self, cfg: DataSection) -> None:
        """Both files there, whole tokens, a window each, ids in the vocabulary (sampled)."""
        self._open(cfg)

    def prepare(self, cfg: DataSection) -> None:
        """Nothing to prepare: the files are read where they are."""

    def load(self, cfg: DataSection, seed: int) -> DatasetSplits:
        """Training and validation windows over the memory-mapped files (the order is the loader's)."""
        from nodescale.data.token_windows import token_splits  # imports torch: see nodescale.data.base

        train, val, vocab = self._open(cfg)
        return token_splits(train, val, cfg.seq_len, vocab)


FORMAT = TokensFormat()
