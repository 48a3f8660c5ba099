"""What the text formats share: documents in, a token cache built once per node, token windows out.

Each text format (``text``, ``jsonl``, ``hf_dataset``) is a :class:`DocumentReader`
that says which files it reads and yields their documents; :class:`TokenisedFormat`
turns those into a token cache (``nodescale.data.token_cache``) in ``prepare``,
one process per node, and hands the cache's directory to the token-window reader
in ``load``. This module stays free of torch for the launcher's ``check``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nodescale.data.base import DatasetSplits
from nodescale.data.token_cache import Document, TokenSource, ensure_token_cache
from nodescale.data.tokenizer_file import open_tokenizer, tokenizer_path
from nodescale.errors import UserError

if TYPE_CHECKING:
    from nodescale.data.section import DataSection


class DocumentReader(Protocol):
    """How one text format finds and reads its documents."""

    def check(self, cfg: DataSection) -> None:
        """Cheap checks (paths exist, the package that reads them is installed); raise ``UserError``."""

    def options(self, cfg: DataSection) -> dict[str, Any]:
        """What is read and how (absolute paths, keys): the cache is named by it."""

    def inputs(self, cfg: DataSection) -> list[Path]:
        """Every file read, in order: their sizes and modification times tell when the cache is stale."""

    def documents(self, cfg: DataSection) -> Iterable[Document]:
        """Each document's split ("train", "val", or None: drawn by data.val_fraction) and text."""


class TokenisedFormat:
    """A text format read through a tokenizer into cached token files."""

    needs_dir = True

    def __init__(self, name: str, reader: DocumentReader) -> None:
        self.name = name
        self.reader = reader

    def check(self, cfg: DataSection) -> None:
        """The sources exist, and the tokenizer opens and has an end-of-document token."""
        self.reader.check(cfg)
        open_tokenizer(tokenizer_path(cfg.tokenizer, self.name), cfg.eos_token, self.name)

    def prepare(self, cfg: DataSection) -> None:
        """Tokenise the documents into the cache, unless a fresh cache is already there."""
        ensure_token_cache(self.source(cfg))

    def load(self, cfg: DataSection, seed: int) -> DatasetSplits:
        """Token windows over the cached files (rebuilt here only if a source changed since ``prepare``)."""
        from nodescale.data.tokens import load_token_splits

        return load_token_splits(ensure_token_cache(self.source(cfg)), cfg, seed)

    def source(self, cfg: DataSection) -> TokenSource:
        """What the cache of this configuration is made from."""
        return TokenSource(
            dataset=self.name,
            where=str(cfg.dir),
            options=self.reader.options(cfg),
            inputs=lambda: self.reader.inputs(cfg),
            documents=lambda: self.reader.documents(cfg),
            tokenizer=tokenizer_path(cfg.tokenizer, self.name),
            eos_token=cfg.eos_token,
            val_fraction=cfg.val_fraction,
        )


class FilesReader:
    """Documents from a file or a directory of files (``--data-dir``), validation ones from ``data.val_dir``.

    ``parse`` yields the documents of one file; ``settings`` name the keys of
    ``data`` that change what it yields.
    """

    def __init__(self, suffix: str, parse: Callable[[Path, DataSection], Iterable[str]],
                 settings: tuple[str, ...]) -> None:
        self.suffix, self.parse, self.settings = suffix, parse, settings

    def check(self, cfg: DataSection) -> None:
        self.inputs(cfg)

    def options(self, cfg: DataSection) -> dict[str, Any]:
        val = val_path(cfg)
        return {"source": str(data_path(cfg)), "val": None if val is None else str(val),
                **{key: getattr(cfg, key) for key in self.settings}}

    def inputs(self, cfg: DataSection) -> list[Path]:
        val = val_path(cfg)
        train = source_files(data_path(cfg), self.suffix, "--data-dir")
        return train if val is None else train + source_files(val, self.suffix, "data.val_dir")

    def documents(self, cfg: DataSection) -> Iterable[Document]:
        val = val_path(cfg)
        for path in source_files(data_path(cfg), self.suffix, "--data-dir"):
            for text in self.parse(path, cfg):
                yield (None if val is None else "train"), text
        for path in [] if val is None else source_files(val, self.suffix, "data.val_dir"):
            for text in self.parse(path, cfg):
                yield "val", text


def source_files(path: Path, suffix: str, what: str) -> list[Path]:
    """``path`` itself, or the ``suffix`` files at any depth under it (sorted, hidden ones skipped)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise UserError(f"{what} {path}", "does not exist", f"pass a {suffix} file or a directory of them")
    found = sorted(p for p in path.rglob(f"*{suffix}") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not found:
        raise UserError(f"{what} {path}", f"holds no {suffix} files", f"pass a {suffix} file or a directory of them")
    return found


def data_path(cfg: DataSection) -> Path:
    """The absolute ``--data-dir``: the cache is keyed by it, identical on every rank."""
    if cfg.dir is None:
        raise UserError(f"dataset {cfg.name!r}", "needs the location of its documents", "pass --data-dir PATH")
    return Path(cfg.dir).expanduser().resolve()


def val_path(cfg: DataSection) -> Path | None:
    """The absolute ``data.val_dir``, if the validation documents have their own source."""
    return None if cfg.val_dir is None else Path(cfg.val_dir).expanduser().resolve()
