"""The text of Python's own help topics (``pydoc_data.topics``), byte by byte: a corpus every Python has.

The topics (the language reference's sections, as ``help()`` shows them) are joined in the
order of their names, a blank line between two, and encoded as UTF-8; each byte is a token,
so the vocabulary is 256 and needs no tokenizer. About 466 KB on Python 3.11; it differs
between Python versions. The last ``data.val_fraction`` of the windows is held out for
validation: the split is cut at a window boundary, the same for every seed.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from nodescale.errors import UserError

if TYPE_CHECKING:
    from nodescale.data.base import DatasetSplits
    from nodescale.data.section import DataSection

VOCAB = 256  # bytes
SEPARATOR = "\n\n"


def corpus_bytes() -> bytes:
    """Every help topic's text in the order of the topics' names, one blank line between two, as UTF-8."""
    from pydoc_data.topics import topics

    return SEPARATOR.join(topics[name] for name in sorted(topics)).encode("utf-8")


def split_point(length: int, seq_len: int, val_fraction: float) -> int:
    """Where training ends: at a window boundary leaving about ``val_fraction`` of the windows, one at least.

    Training takes ``tokens[:cut + 1]`` and validation ``tokens[cut:]``: the token at ``cut`` is the last
    training target and the first validation input, so no token is a target in both.
    """
    windows = (length - 1) // seq_len
    if windows < 2:
        raise UserError(f"--seq-len {seq_len} with dataset 'pydoc' ({length:,} bytes)",
                        "leaves fewer than one window each for training and validation",
                        f"use --seq-len {max(1, (length - 1) // 2)} or less")
    train_windows = min(windows - 1, max(1, round(windows * (1 - val_fraction))))
    return train_windows * seq_len


class PydocFormat:
    """The help topics' bytes in windows of ``data.seq_len`` + 1, split by ``data.val_fraction``."""

    name = "pydoc"
    needs_dir = False

    def check(self, cfg: DataSection) -> None:
        """The text must be installed (some distributions ship the standard library without it)."""
        if importlib.util.find_spec("pydoc_data") is None:
            raise UserError("dataset 'pydoc'", "needs the pydoc_data package of Python's standard library",
                            "install your distribution's full Python standard library, or use --dataset tokens")

    def prepare(self, cfg: DataSection) -> None:
        """Nothing to prepare: the text is part of Python."""

    def load(self, cfg: DataSection, seed: int) -> DatasetSplits:
        """Both splits in memory as uint8 tensors (the seed orders the windows in the loader, not here)."""
        import torch  # not at the top: see nodescale.data.base

        from nodescale.data.token_windows import token_splits

        data = corpus_bytes()
        cut = split_point(len(data), cfg.seq_len, cfg.val_fraction)
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return token_splits(tokens[:cut + 1], tokens[cut:], cfg.seq_len, VOCAB)


FORMAT = PydocFormat()
