"""Text tokenised once into nanoGPT-style token files, cached atomically on a shared filesystem.

A cache is a directory ``$NODESCALE_CACHE_DIR/tokens/<format>-<hash>/`` holding

* ``train.bin`` and ``val.bin``: flat token ids (uint16 when the vocabulary has
  at most 65,536 entries, else uint32), each document followed by the
  end-of-document token;
* ``meta.json``: the vocabulary size, dtype, end-of-document token and id,
  token and document counts, and what the cache was made from.

The directory's name hashes what is read and how (source paths, text key,
tokenizer path, options); ``meta.json`` records the fingerprint of the inputs
(each source file's size and modification time, the tokenizer's SHA-256). A
cache is used only while that fingerprint still matches, else it is rebuilt.

Several nodes may build the same cache at once: each writes a temporary
directory beside the target and renames it into place. A rename is atomic, so
readers see no cache or a whole one, never part of one; the first rename wins
and a later builder that finds the finished cache uses it. Documents are
tokenised in batches and streamed to disk, so a corpus never sits in memory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np

from nodescale.atomic_files import sync_directory, write_json_atomic
from nodescale.data.cache_location import CACHE_ENV, cache_dir
from nodescale.data.tokenizer_file import TextTokenizer, file_sha256, open_tokenizer
from nodescale.errors import UserError

CACHE_VERSION = 1
BATCH_DOCUMENTS = 1024  # texts per encode_batch call: enough to keep the tokenizer's threads busy
BATCH_CHARACTERS = 8 << 20  # and a bound on the memory one batch takes

Split = Literal["train", "val"]
Document = tuple[Split | None, str]  # None: the split is drawn from val_fraction


@dataclass(frozen=True)
class TokenSource:
    """Everything that decides what a token cache holds.

    ``options`` say what is read and how (paths, keys) and name the cache;
    ``inputs`` are the files read, whose sizes and modification times tell
    when it is stale; ``documents`` yields each document's text with its split,
    or with None to let ``val_fraction`` choose.
    """

    dataset: str
    where: str  # the source as the user named it, for messages
    options: dict[str, Any]
    inputs: Callable[[], list[Path]]
    documents: Callable[[], Iterable[Document]]
    tokenizer: Path
    eos_token: str | None
    val_fraction: float


def cache_path(source: TokenSource) -> Path:
    """The cache directory of ``source``, named by a hash of what is read and how."""
    identity = json.dumps(_identity(source), sort_keys=True)
    key = hashlib.sha256(identity.encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return cache_dir() / "tokens" / f"{source.dataset}-{key}"


def ensure_token_cache(source: TokenSource) -> Path:
    """The directory of ``source``'s token files: the cached one while fresh, else one built now."""
    target = cache_path(source)
    # The fingerprint is taken before reading: a file changed meanwhile leaves a stale cache, never a wrong one.
    fingerprint = _fingerprint(source)
    if read_meta(target, source, fingerprint) is not None:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    except OSError as err:
        raise UserError(
            f"token cache {target.parent}", f"cannot be written ({err})",
            f"point {CACHE_ENV} at a writable directory that every node sees (e.g. on the scratch filesystem)",
        ) from err
    try:
        _build(source, tmp, fingerprint)
        _install(tmp, target, source, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when renamed into place
    return target


def read_meta(directory: Path, source: TokenSource, fingerprint: dict[str, Any]) -> dict[str, Any] | None:
    """``directory``'s meta.json if it is a whole cache of ``source`` with this fingerprint, else None."""
    try:
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
        if (meta.get("version") != CACHE_VERSION or meta.get("identity") != _identity(source)
                or meta.get("fingerprint") != fingerprint):
            return None
        itemsize = np.dtype(meta["dtype"]).itemsize
        for split in ("train", "val"):  # a damaged cache is rebuilt, not read
            if (directory / f"{split}.bin").stat().st_size != meta[f"{split}_tokens"] * itemsize:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return meta


def _identity(source: TokenSource) -> dict[str, Any]:
    return {"format": source.dataset, **source.options, "tokenizer": str(source.tokenizer),
            "eos_token": source.eos_token, "val_fraction": source.val_fraction}


def _fingerprint(source: TokenSource) -> dict[str, Any]:
    """Digest of every input's path, size and modification time, and the tokenizer's SHA-256."""
    digest = hashlib.sha256()
    files = total = 0
    for path in source.inputs():
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
        files, total = files + 1, total + stat.st_size
    return {"files": files, "bytes": total, "files_sha256": digest.hexdigest(),
            "tokenizer_sha256": file_sha256(source.tokenizer)}


class _SplitWriter:
    """Token ids of one split appended to its file, with running counts."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.handle: IO[bytes] = path.open("wb")
        self.dtype = dtype
        self.tokens = self.documents = 0

    def write(self, documents: list[list[int]], eos_id: int) -> None:
        if not documents:
            return
        count = sum(map(len, documents)) + len(documents)
        # Python code per document, none per token: a corpus may hold billions of them.
        ids = np.fromiter(chain.from_iterable(chain.from_iterable((doc, (eos_id,)) for doc in documents)),
                          self.dtype, count)
        self.handle.write(ids.tobytes())
        self.tokens += len(ids)
        self.documents += len(documents)

    def close(self) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()


def is_validation(index: int, val_fraction: float) -> bool:
    """Whether document ``index`` is held out: evenly spread, round(n * val_fraction) of the first n.

    Fixed by the document's position alone (not the run's seed), so one cache serves every run.
    """
    return math.floor((index + 1) * val_fraction + 0.5) > math.floor(index * val_fraction + 0.5)


def _build(source: TokenSource, tmp: Path, fingerprint: dict[str, Any]) -> None:
    """Tokenise ``source`` into ``tmp``: train.bin, val.bin, then meta.json."""
    tokenizer = open_tokenizer(source.tokenizer, source.eos_token, source.dataset)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    writers = {split: _SplitWriter(tmp / f"{split}.bin", dtype) for split in ("train", "val")}
    drawn = 0  # documents whose split val_fraction chose
    try:
        batch: list[tuple[Split, str]] = []
        characters = 0
        for split, text in source.documents():
            if not text:
                continue  # an empty document would be a lone end-of-document token
            if split is None:
                split, drawn = ("val" if is_validation(drawn, source.val_fraction) else "train"), drawn + 1
            batch.append((split, text))
            characters += len(text)
            if len(batch) >= BATCH_DOCUMENTS or characters >= BATCH_CHARACTERS:
                _encode(batch, tokenizer, writers)
                batch, characters = [], 0
        _encode(batch, tokenizer, writers)
    finally:
        for writer in writers.values():
            writer.close()
    _check_splits(source, writers["train"].documents, writers["val"].documents, drawn)
    write_json_atomic(tmp / "meta.json", {
        "version": CACHE_VERSION,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.name,
        "eos_token": tokenizer.eos_token,
        "eos_id": tokenizer.eos_id,
        **{f"{split}_tokens": writer.tokens for split, writer in writers.items()},
        **{f"{split}_documents": writer.documents for split, writer in writers.items()},
        "identity": _identity(source),
        "fingerprint": fingerprint,
    })
    sync_directory(tmp)


def _encode(batch: list[tuple[Split, str]], tokenizer: TextTokenizer, writers: dict[str, _SplitWriter]) -> None:
    ids = tokenizer.encode_batch([text for _, text in batch])
    for split, writer in writers.items():
        writer.write([doc for (s, _), doc in zip(batch, ids, strict=True) if s == split], tokenizer.eos_id)


def _check_splits(source: TokenSource, train: int, val: int, drawn: int) -> None:
    if train + val == 0:
        raise UserError(f"dataset {source.dataset!r} from {source.where}", "holds no text",
                        "point --data-dir at the files that hold the documents")
    if train and val:
        return
    if drawn:
        raise UserError(
            f"dataset {source.dataset!r} from {source.where}",
            f"has {drawn} document{'s' if drawn != 1 else ''}: too few to hold out"
            f" data.val_fraction={source.val_fraction} of them and train on the rest (each needs one)",
            "add documents, change data.val_fraction, or give a validation source with --set data.val_dir=PATH",
        )
    missing = "validation" if not val else "training"
    raise UserError(f"dataset {source.dataset!r} from {source.where}", f"has no {missing} text",
                    f"give the {missing} split some documents")


def _install(tmp: Path, target: Path, source: TokenSource, fingerprint: dict[str, Any]) -> None:
    """Rename ``tmp`` to ``target``; if another builder got there first, keep its cache when it is fresh."""
    for _ in range(3):
        try:
            os.rename(tmp, target)  # refused when target exists and is not empty
            sync_directory(target.parent)
            return
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        if read_meta(target, source, fingerprint) is not None:
            return  # another node won; its files equal ours
        aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.stale-"))
        try:
            os.rename(target, aside / "cache")  # a stale cache: move it out of the way, then retry
        except FileNotFoundError:
            pass  # another builder moved it first
        shutil.rmtree(aside, ignore_errors=True)
    raise UserError(f"token cache {target}", "kept being replaced by other processes while this one built it",
                    "make sure the source files do not change during the run")
