"""Text, JSON Lines and saved Hugging Face datasets tokenised once into cached token files.

A tiny tokenizer is trained here with ``tokenizers`` (nothing is downloaded).
Token files are compared with what that tokenizer gives for the same text, one
document at a time through ``encode``, not the batch path the cache uses.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nodescale.cli.main import main
from nodescale.config.schema import DataSection
from nodescale.data import hf_dataset, jsonl, text, token_cache
from nodescale.data.token_cache import ensure_token_cache, is_validation
from nodescale.errors import UserError
from required import require_module

REPO = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"
PARAGRAPHS = [
    "The cat sat on the mat.\nIt was a sunny day.",
    "Dogs bark at night;   cats sleep.",
    "Ünïcödé paragraphs work too: naïve café, 東京.",
    "    indented line\n\tand a tab",
    "short",
    "A paragraph after two blank lines.",
    "one more",
    "The last paragraph has no final newline",
]
VAL_AT_A_QUARTER = [1, 5]  # is_validation(i, 0.25) for the 8 paragraphs: round(n / 4) of the first n


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch) -> Path:
    """Token caches go to a per-test directory, never to ~/.cache."""
    path = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("NODESCALE_CACHE_DIR", str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A byte-level BPE of 300 tokens with GPT-2's end-of-text token, trained on a few lines."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(PARAGRAPHS * 3, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def word_tokenizer(path: Path, size: int, specials: tuple[str, ...] = ()) -> Path:
    """A word-level tokenizer of ``size`` entries: the ``specials``, then w0, w1, ..."""
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=specials[0] if specials else "w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def settings(name: str, data: Path, tokenizer: Path, **keys) -> DataSection:
    return DataSection(name=name, dir=data, tokenizer=tokenizer, **keys)


def read_cache(directory: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    meta = json.loads((directory / "meta.json").read_text())
    train, val = (np.fromfile(directory / f"{split}.bin", dtype=meta["dtype"]) for split in ("train", "val"))
    return meta, train, val


def expected_ids(tokenizer_path: Path, documents: list[str]) -> list[int]:
    """Each document's ids from ``Tokenizer.encode``, followed by the end-of-text id."""
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos = tokenizer.token_to_id(EOS)
    return [i for doc in documents for i in (*tokenizer.encode(doc, add_special_tokens=False).ids, eos)]


def build(fmt, cfg: DataSection) -> Path:
    fmt.check(cfg)
    return ensure_token_cache(fmt.source(cfg))


def write_paragraphs(path: Path, paragraphs: list[str]) -> Path:
    # Blank lines between paragraphs, one of them two lines long and one holding only white space.
    text = paragraphs[0] + "\n\n" + "\n \t\n".join(paragraphs[1:5]) + "\n\n\n" + "\n\n".join(paragraphs[5:])
    path.write_text(text, encoding="utf-8")
    return path


def split(documents: list[str], val: list[int]) -> tuple[list[str], list[str]]:
    return [d for i, d in enumerate(documents) if i not in val], [documents[i] for i in val]


# ---------------------------------------------------------------- what the caches hold


def test_validation_documents_are_evenly_spread_and_round_to_the_fraction():
    assert [i for i in range(8) if is_validation(i, 0.25)] == VAL_AT_A_QUARTER
    for fraction in (0.01, 0.1, 0.2, 0.25, 0.5, 0.9):
        for n in range(1, 60):
            held = sum(is_validation(i, fraction) for i in range(n))
            assert held == int(n * fraction + 0.5), (fraction, n)  # round half up


def test_text_paragraphs_become_documents_with_eos_between_them(tmp_path, tokenizer_file):
    source = write_paragraphs(tmp_path / "corpus.txt", PARAGRAPHS)
    directory = build(text.FORMAT, settings("text", source, tokenizer_file, val_fraction=0.25))
    meta, train, val = read_cache(directory)
    train_docs, val_docs = split(PARAGRAPHS, VAL_AT_A_QUARTER)
    assert train.tolist() == expected_ids(tokenizer_file, train_docs)
    assert val.tolist() == expected_ids(tokenizer_file, val_docs)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    assert meta["vocab_size"] == tokenizer.get_vocab_size() == 300
    assert (meta["dtype"], meta["eos_token"], meta["eos_id"]) == ("uint16", EOS, tokenizer.token_to_id(EOS))
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
    assert (meta["train_documents"], meta["val_documents"]) == (6, 2)
    assert meta["fingerprint"]["files"] == 1 and meta["fingerprint"]["bytes"] == source.stat().st_size


def test_text_files_as_documents_with_a_validation_directory(tmp_path, tokenizer_file):
    corpus, held_out = tmp_path / "corpus", tmp_path / "held_out"
    for rel, body in [("b.txt", PARAGRAPHS[1]), ("a/z.txt", PARAGRAPHS[0]), ("c.txt", "x\n\ny\n"),
                      ("notes.md", "not text"), (".hidden/d.txt", "hidden"), ("v/1.txt", PARAGRAPHS[4])]:
        root = held_out if rel.startswith("v/") else corpus
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(body, encoding="utf-8")
    cfg = settings("text", corpus, tokenizer_file, text_unit="file", val_dir=held_out)
    _, train, val = read_cache(build(text.FORMAT, cfg))
    assert train.tolist() == expected_ids(tokenizer_file, [PARAGRAPHS[0], PARAGRAPHS[1], "x\n\ny\n"])
    assert val.tolist() == expected_ids(tokenizer_file, [PARAGRAPHS[4]])


def test_jsonl_reads_the_text_key_of_each_line(tmp_path, tokenizer_file):
    lines = [json.dumps({"body": doc, "id": i}) for i, doc in enumerate(PARAGRAPHS)]
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n", encoding="utf-8")
    _, train, val = read_cache(build(jsonl.FORMAT, settings("jsonl", source, tokenizer_file, text_key="body",
                                                              val_fraction=0.25)))
    train_docs, val_docs = split(PARAGRAPHS, VAL_AT_A_QUARTER)
    assert train.tolist() == expected_ids(tokenizer_file, train_docs)
    assert val.tolist() == expected_ids(tokenizer_file, val_docs)


def test_hf_dataset_takes_its_train_and_validation_splits(tmp_path, tokenizer_file):
    datasets = require_module("datasets", "a saved Hugging Face dataset")
    saved = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"content": PARAGRAPHS[:5], "n": list(range(5))}),
        "validation": datasets.Dataset.from_dict({"content": PARAGRAPHS[5:], "n": list(range(3))}),
    })
    saved.save_to_disk(str(tmp_path / "dict"))
    _, train, val = read_cache(build(hf_dataset.FORMAT, settings("hf_dataset", tmp_path / "dict", tokenizer_file,
                                                                 text_key="content")))
    assert train.tolist() == expected_ids(tokenizer_file, PARAGRAPHS[:5])
    assert val.tolist() == expected_ids(tokenizer_file, PARAGRAPHS[5:])

    datasets.Dataset.from_dict({"text": PARAGRAPHS}).save_to_disk(str(tmp_path / "one"))
    _, train, val = read_cache(build(hf_dataset.FORMAT, settings("hf_dataset", tmp_path / "one", tokenizer_file,
                                                                 val_fraction=0.25)))
    train_docs, val_docs = split(PARAGRAPHS, VAL_AT_A_QUARTER)
    assert train.tolist() == expected_ids(tokenizer_file, train_docs)
    assert val.tolist() == expected_ids(tokenizer_file, val_docs)


@pytest.mark.parametrize(("size", "dtype"), [(65536, "uint16"), (65537, "uint32")])
def test_dtype_holds_the_largest_id(tmp_path, size, dtype):
    tokenizer = word_tokenizer(tmp_path / "tok", size, specials=("<unk>", "</s>"))
    top = f"w{size - 1}"
    (tmp_path / "c.txt").write_text(f"w2 {top}\n\nw7 w3 {top}\n", encoding="utf-8")
    meta, train, val = read_cache(build(text.FORMAT, settings("text", tmp_path / "c.txt", tokenizer,
                                                              val_fraction=0.5)))
    assert (meta["dtype"], meta["vocab_size"], meta["eos_token"], meta["eos_id"]) == (dtype, size, "</s>", 1)
    assert val.tolist() == [2, size - 1, 1] and train.tolist() == [7, 3, size - 1, 1]  # document 0 is held out


def test_eos_from_tokenizer_config_or_the_eos_token_key(tmp_path):
    tokenizer = word_tokenizer(tmp_path / "tok", 50, specials=("<unk>", "<sep>", "<end>"))
    (tmp_path / "c.txt").write_text("w5\n\nw6\n", encoding="utf-8")
    cfg = settings("text", tmp_path / "c.txt", tokenizer.parent, val_fraction=0.5)  # the directory will do
    with pytest.raises(UserError, match="data.eos_token=TOKEN"):
        text.FORMAT.check(cfg)
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<end>"}))
    assert read_cache(build(text.FORMAT, cfg))[1].tolist() == [6, 2]  # document 0 is held out
    cfg.eos_token = "<sep>"
    assert read_cache(build(text.FORMAT, cfg))[1].tolist() == [6, 1]


def test_load_gives_token_windows_over_the_cache(tmp_path, tokenizer_file):
    source = write_paragraphs(tmp_path / "corpus.txt", PARAGRAPHS * 20)
    cfg = settings("text", source, tokenizer_file, val_fraction=0.25)
    text.FORMAT.prepare(cfg)
    directory = token_cache.cache_path(text.FORMAT.source(cfg))
    inode = (directory / "train.bin").stat().st_ino
    splits = text.FORMAT.load(cfg, seed=0)
    meta, train, _ = read_cache(directory)
    assert (directory / "train.bin").stat().st_ino == inode  # load read prepare's cache
    assert splits.spec.num_classes == meta["vocab_size"] and splits.spec.task == "language_modeling"
    x, y = splits.train[1]
    length = len(x)
    assert len(splits.train) == (len(train) - 1) // length
    assert x.tolist() == train[length:2 * length].tolist() and y.tolist() == train[length + 1:2 * length + 1].tolist()


# ---------------------------------------------------------------- the cache: reused, rebuilt, atomic


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "tokens").iterdir() if p.name.startswith("."))


def test_unchanged_sources_reuse_the_cache_and_changed_ones_rebuild_it(tmp_path, tokenizer_file, cache_dir):
    source = write_paragraphs(tmp_path / "corpus.txt", PARAGRAPHS)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_bytes(tokenizer_file.read_bytes())
    cfg = settings("text", source, tokenizer, val_fraction=0.25)
    first = build(text.FORMAT, cfg)
    stat, stat_of_source = (first / "train.bin").stat(), source.stat()
    assert build(text.FORMAT, cfg) == first
    assert ((first / "train.bin").stat().st_ino, (first / "train.bin").stat().st_mtime_ns) == (
        stat.st_ino, stat.st_mtime_ns)

    changed = [PARAGRAPHS[0].replace("cat", "dog"), *PARAGRAPHS[1:]]
    write_paragraphs(source, changed)  # same size: only the modification time tells
    os.utime(source, ns=(stat_of_source.st_atime_ns, stat_of_source.st_mtime_ns + 10**9))  # coarse clocks
    assert source.stat().st_size == stat_of_source.st_size
    assert build(text.FORMAT, cfg) == first  # one cache per source, replaced
    _, train, _ = read_cache(first)
    assert (first / "train.bin").stat().st_ino != stat.st_ino
    assert train.tolist() == expected_ids(tokenizer_file, split(changed, VAL_AT_A_QUARTER)[0])

    rebuilt = (first / "train.bin").stat().st_ino
    tokenizer.write_text(json.dumps(json.loads(tokenizer.read_text())))  # same tokenizer, other bytes
    build(text.FORMAT, cfg)
    assert (first / "train.bin").stat().st_ino != rebuilt
    assert leftovers(cache_dir) == []


def test_a_damaged_or_partial_cache_is_never_read(tmp_path, tokenizer_file, cache_dir):
    source = write_paragraphs(tmp_path / "corpus.txt", PARAGRAPHS)
    cfg = settings("text", source, tokenizer_file, val_fraction=0.25)
    target = token_cache.cache_path(text.FORMAT.source(cfg))
    target.mkdir(parents=True)
    (target / "train.bin").write_bytes(b"\x01\x00" * 7)  # a cache without meta.json
    _, train, _ = read_cache(build(text.FORMAT, cfg))
    assert train.tolist() == expected_ids(tokenizer_file, split(PARAGRAPHS, VAL_AT_A_QUARTER)[0])
    with (target / "val.bin").open("r+b") as handle:  # cut short
        handle.truncate(4)
    assert read_cache(build(text.FORMAT, cfg))[2].tolist() == expected_ids(tokenizer_file, split(
        PARAGRAPHS, VAL_AT_A_QUARTER)[1])
    assert leftovers(cache_dir) == []


def test_a_builder_that_loses_the_race_uses_the_winners_cache(tmp_path, tokenizer_file, cache_dir, monkeypatch):
    source = write_paragraphs(tmp_path / "corpus.txt", PARAGRAPHS)
    cfg = settings("text", source, tokenizer_file, val_fraction=0.25)
    winner = build(text.FORMAT, cfg)
    inode = (winner / "train.bin").stat().st_ino
    real = token_cache.read_meta
    looks = []

    def not_there_at_first(*args):  # the loser looked before the winner's rename
        looks.append(args)
        return None if len(looks) == 1 else real(*args)

    monkeypatch.setattr(token_cache, "read_meta", not_there_at_first)
    assert ensure_token_cache(text.FORMAT.source(cfg)) == winner
    assert len(looks) == 2 and (winner / "train.bin").stat().st_ino == inode
    assert leftovers(cache_dir) == []


def test_concurrent_builders_agree_on_one_whole_cache(tmp_path, tokenizer_file, cache_dir):
    source = write_paragraphs(tmp_path / "corpus.txt", PARAGRAPHS * 50)
    cfg = settings("text", source, tokenizer_file, val_fraction=0.25)
    results: list[Path | BaseException] = []

    def builder() -> None:
        try:
            results.append(ensure_token_cache(text.FORMAT.source(cfg)))
        except BaseException as err:
            results.append(err)

    threads = [threading.Thread(target=builder) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and isinstance(results[0], Path), results
    _, train, _ = read_cache(results[0])
    assert train.tolist() == expected_ids(tokenizer_file, split(PARAGRAPHS * 50, [
        i for i in range(400) if is_validation(i, 0.25)])[0])
    assert leftovers(cache_dir) == []


# ---------------------------------------------------------------- bad input


def refused(fmt, cfg: DataSection, *named: str) -> UserError:
    with pytest.raises(UserError) as err:
        build(fmt, cfg)
    for part in named:
        assert part in str(err.value), f"{part!r} not in: {err.value}"
    return err.value


def test_missing_unset_or_unreadable_tokenizer(tmp_path):
    source = write_paragraphs(tmp_path / "c.txt", PARAGRAPHS)
    refused(text.FORMAT, settings("text", source, tmp_path / "nope.json"), str(tmp_path / "nope.json"),
            "does not exist")
    refused(text.FORMAT, DataSection(name="text", dir=source), "data.tokenizer=")
    for content in ['{"version": "1.0", "model": {"type": "Nothing"}}', "not json at all"]:
        (tmp_path / "bad.json").write_text(content)
        refused(text.FORMAT, settings("text", source, tmp_path / "bad.json"), str(tmp_path / "bad.json"),
                "cannot be read by tokenizers")


def test_no_end_of_document_token(tmp_path):
    tokenizer = word_tokenizer(tmp_path / "tok", 20, specials=("<unk>",))
    source = write_paragraphs(tmp_path / "c.txt", PARAGRAPHS)
    refused(text.FORMAT, settings("text", source, tokenizer), str(tokenizer), "end-of-document", "data.eos_token")
    refused(text.FORMAT, settings("text", source, tokenizer, eos_token="<eot>"), "'<eot>'", "not in the vocabulary")


def test_jsonl_lines_without_text_or_json_name_file_and_line(tmp_path, tokenizer_file):
    source = tmp_path / "d.jsonl"
    source.write_text('{"text": "fine"}\n{"title": "no text", "body": "x"}\n', encoding="utf-8")
    refused(jsonl.FORMAT, settings("jsonl", source, tokenizer_file), f"{source}:2", "'text'", "'title'",
            "data.text_key")
    source.write_text('{"text": "fine"}\n\n{"text": "ok"}\n{"text": "unfinished\n', encoding="utf-8")
    refused(jsonl.FORMAT, settings("jsonl", source, tokenizer_file), f"{source}:4", "not a JSON object")
    source.write_text('{"text": 3}\n["text"]\n', encoding="utf-8")
    refused(jsonl.FORMAT, settings("jsonl", source, tokenizer_file), f"{source}:1", "int, not a string")


def test_empty_corpus_and_too_few_documents(tmp_path, tokenizer_file):
    (tmp_path / "blank.txt").write_text("\n \n\t\n", encoding="utf-8")
    refused(text.FORMAT, settings("text", tmp_path / "blank.txt", tokenizer_file), "holds no text")
    (tmp_path / "empty").mkdir()
    refused(text.FORMAT, settings("text", tmp_path / "empty", tokenizer_file), "holds no .txt files")
    (tmp_path / "one.txt").write_text("just one paragraph\n", encoding="utf-8")
    refused(text.FORMAT, settings("text", tmp_path / "one.txt", tokenizer_file), "1 document", "data.val_dir")
    refused(text.FORMAT, settings("text", tmp_path / "one.txt", tokenizer_file, val_dir=tmp_path / "blank.txt"),
            "no validation text")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n\nna\xefve\n".encode("latin-1"))
    refused(text.FORMAT, settings("text", tmp_path / "latin1.txt", tokenizer_file), "latin1.txt", "not UTF-8")


def test_hf_dataset_bad_directories(tmp_path, tokenizer_file):
    datasets = require_module("datasets", "a saved Hugging Face dataset")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "x.txt").write_text("not a saved dataset")
    refused(hf_dataset.FORMAT, settings("hf_dataset", tmp_path / "plain", tokenizer_file), str(tmp_path / "plain"),
            "save_to_disk")
    datasets.Dataset.from_dict({"body": ["a", "b"]}).save_to_disk(str(tmp_path / "saved"))
    refused(hf_dataset.FORMAT, settings("hf_dataset", tmp_path / "saved", tokenizer_file), "column 'text'", "'body'")
    refused(hf_dataset.FORMAT, settings("hf_dataset", tmp_path / "saved", tokenizer_file, val_dir=tmp_path),
            "data.val_dir")


@pytest.mark.parametrize(("package", "fmt"), [("tokenizers", text.FORMAT), ("datasets", hf_dataset.FORMAT)])
def test_a_missing_optional_package_names_the_lm_extra(tmp_path, tokenizer_file, monkeypatch, package, fmt):
    write_paragraphs(tmp_path / "c.txt", PARAGRAPHS)
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    refused(fmt, settings(fmt.name, tmp_path / "c.txt", tokenizer_file), f"needs the {package} package",
            "pip install 'nodescale[lm]'")


def test_the_cli_exits_2_without_a_traceback(tmp_path):
    source = write_paragraphs(tmp_path / "c.txt", PARAGRAPHS)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", "--model", f"{REPO}/tests/user_code/user.py:build", "--dataset", "text",
                     "--data-dir", str(source), "--set", f"data.tokenizer={tmp_path / 'missing.json'}",
                     "--out", str(tmp_path / "run")])
    assert code == 2 and "Traceback" not in err.getvalue()
    assert f"tokenizer {tmp_path / 'missing.json'}: does not exist" in err.getvalue()
    assert not (tmp_path / "run").exists() and os.listdir(tmp_path) == ["c.txt"]
