"""A local Hugging Face ``tokenizer.json``: opened, checked, and its end-of-document token found.

``tokenizers`` is an optional package (the ``lm`` extra), imported only here and
only when a text format needs it. Nothing is ever downloaded: the tokenizer is
a file the user names with ``data.tokenizer``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodescale.errors import UserError

LM_EXTRA = "pip install 'nodescale[lm]'"
# End-of-document tokens of the common tokenizer families, most common first:
# GPT-2/NeoX/Pythia, Llama-2/Mistral/T5, Llama-3, Gemma.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


def require(package: str, dataset: str) -> Any:
    """The optional ``package`` imported, or the error that says how to install it."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise UserError(f"dataset {dataset!r}", f"needs the {package} package", LM_EXTRA) from err


def tokenizer_path(setting: Path | None, dataset: str) -> Path:
    """The absolute ``tokenizer.json`` that ``data.tokenizer`` names (the file, or a directory holding it)."""
    if setting is None:
        raise UserError(
            f"dataset {dataset!r}",
            "needs a tokenizer to turn text into tokens",
            "--set data.tokenizer=PATH/tokenizer.json (a Hugging Face tokenizers file, e.g. from a model directory)",
        )
    path = Path(setting).expanduser().resolve()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UserError(
            f"tokenizer {path}",
            "does not exist",
            "--set data.tokenizer=PATH/tokenizer.json (a Hugging Face tokenizers file, e.g. from a model directory)",
        )
    return path


def file_sha256(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class TextTokenizer:
    """A loaded tokenizer, its vocabulary size and the id that ends every document."""

    tokenizer: Any  # tokenizers.Tokenizer
    vocab_size: int
    eos_token: str
    eos_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without the special tokens a post-processor would add (BOS and the like)."""
        # The fast variant (tokenizers >= 0.20) skips the character offsets: same ids, a third less time.
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]


def open_tokenizer(path: Path, eos_token: str | None, dataset: str) -> TextTokenizer:
    """The tokenizer in ``path`` and its end-of-document token: ``eos_token`` if given, else its own."""
    tokenizers = require("tokenizers", dataset)
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for any file it cannot read
        raise UserError(
            f"tokenizer {path}",
            f"cannot be read by tokenizers {tokenizers.__version__} ({err})",
            "give the tokenizer.json of a Hugging Face fast tokenizer (saved by tokenizers or transformers);"
            " a newer tokenizers may read it: pip install -U tokenizers",
        ) from err
    name = eos_token or _configured_eos(path) or next(
        (candidate for candidate in EOS_NAMES if tokenizer.token_to_id(candidate) is not None), None
    )
    if name is None:
        raise UserError(
            f"tokenizer {path}",
            f"has no end-of-document token nodescale knows ({', '.join(EOS_NAMES)}),"
            " and its directory has no tokenizer_config.json naming one",
            "name the token that separates documents: --set data.eos_token=TOKEN",
        )
    eos_id = tokenizer.token_to_id(name)
    if eos_id is None:
        raise UserError(
            f"end-of-document token {name!r}",
            f"is not in the vocabulary of {path}",
            "--set data.eos_token=TOKEN with a token of this tokenizer (e.g. its <|endoftext|> or </s>)",
        )
    return TextTokenizer(tokenizer, tokenizer.get_vocab_size(with_added_tokens=True), name, eos_id)


def _configured_eos(path: Path) -> str | None:
    """The ``eos_token`` that transformers' ``tokenizer_config.json`` beside ``path`` names, if any."""
    try:
        config = json.loads((path.parent / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    token = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(token, dict):  # older transformers saved an AddedToken as a dict
        token = token.get("content")
    return token if isinstance(token, str) and token else None
