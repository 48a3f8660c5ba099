"""The shards format and ``nodescale data pack``/``inspect``: real tar files written and read here.

Which rank reads which sample is ShardPlan's (tests/test_sharding.py: once per epoch on 1, 2 and
3 ranks); here: the tar reading, packing, staging, bad input, and real training runs: a packed
folder trains to the folder's weights under data.order=sequential, and 2 ranks resume exactly.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from conftest import cli_env, final_weights, max_difference, read_summary, run_cli
from nodescale.config.schema import DataSection
from nodescale.data.epoch_loader import EpochLoader
from nodescale.data.pack import pack, parse_size, plan_shards
from nodescale.data.registry import get_format
from nodescale.data.sharding import ShardPlan
from nodescale.data.shards import expand_braces, find_shards
from nodescale.errors import UserError

SGD = ["--optimizer", "sgd", "--lr", "0.05", "--set", "optim.schedule=constant", "--no-progress", "--seed", "3",
       "--model", "cnn", "--batch-size", "4"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NODESCALE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_folder(root: Path, per_class: int = 8, splits: tuple[str, ...] = ("train", "val")) -> Path:
    """12x12 class folders of PNGs and JPEGs (the JPEGs' bytes are kept as they are by pack)."""
    rng = np.random.default_rng(0)
    for split in splits:
        for name in ("ant", "bee", "cow"):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class if split == "train" else 2):
                pixels = rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / (f"{i:02d}.png" if i % 2 else f"{i:02d}.jpg"))
    return root


def load(location: Path | str, **fields):  # noqa: ANN201
    cfg = DataSection(name="shards", dir=Path(location), **fields)
    fmt = get_format("shards")
    fmt.check(cfg)
    fmt.prepare(cfg)
    return fmt.load(cfg, seed=0)


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("packed")
    write_folder(root / "folder")
    pack(root / "folder", root / "shards", parse_size("8KB"), workers=2)
    return root


# ---------------------------------------------------------------- pack, read, inspect


def test_pack_keeps_the_bytes_and_the_order_and_writes_a_manifest(packed: Path) -> None:
    manifest = json.loads((packed / "shards" / "manifest.json").read_text())
    assert manifest["classes"] == ["ant", "bee", "cow"]
    assert manifest["splits"]["train"]["samples"] == 24 and manifest["splits"]["val"]["samples"] == 6
    assert manifest["splits"]["train"]["class_counts"] == [8, 8, 8]
    shards = manifest["splits"]["train"]["shards"]
    assert len(shards) > 2 and sum(s["samples"] for s in shards) == 24
    with tarfile.open(packed / "shards" / shards[0]["name"]) as tar:
        names = tar.getnames()
        assert names[:2] == ["000000000.jpg", "000000000.cls"]
        original = (packed / "folder" / "train" / "ant" / "00.jpg").read_bytes()
        assert tar.extractfile(names[0]).read() == original  # not re-encoded
    splits = load(packed / "shards")
    folder = get_format("imagefolder").load(DataSection(name="imagefolder", dir=packed / "folder"), seed=0)
    assert splits.spec == folder.spec
    for i in (0, 5, 23):
        assert torch.equal(splits.train[i][0], folder.train[i][0]) and splits.train[i][1] == folder.train[i][1]


@pytest.mark.parametrize("source", ["mnist", "cifar10", "hdf5-hwc", "hdf5-grey", "hdf5-lumi"])
def test_packed_arrays_read_as_their_source_format_reads_them(source: str, tmp_path: Path) -> None:
    import test_data_formats as formats  # the writers of real MNIST, CIFAR-10 and HDF5 files

    name, layout = source.split("-")[0], {"hdf5-hwc": "groups", "hdf5-grey": "keras", "hdf5-lumi":
                                             "lumi-tiny-imagenet"}.get(source)
    where = tmp_path / ("data.h5" if layout else "src")
    if layout:
        formats.write_hdf5(where, *formats.HDF5_LAYOUTS[layout])
    else:
        (formats.write_mnist(where, gz=True) if name == "mnist" else formats.write_cifar(where))
    pack(where, tmp_path / "shards", parse_size("20KB"), workers=1)
    theirs = get_format(name).load(DataSection(name=name, dir=where), seed=0)
    ours = load(tmp_path / "shards")
    assert ours.spec == theirs.spec and len(ours.val) == len(theirs.val)  # the LUMI file: split with the seed
    for mine, source_set in ((ours.train, theirs.train), (ours.val, theirs.val)):
        for i in (0, len(mine) - 1):
            assert torch.equal(mine[i][0], source_set[i][0]) and mine[i][1] == source_set[i][1]


def test_pack_as_two_cluster_tasks_makes_the_same_shards_and_the_last_writes_the_manifest(
        packed: Path, tmp_path: Path) -> None:
    out = tmp_path / "two"
    first = pack(packed / "folder", out, parse_size("8KB"), workers=1, environ={"SLURM_PROCID": "1",
                                                                               "SLURM_NTASKS": "2"})
    assert first is None and not (out / "manifest.json").exists()
    second = pack(packed / "folder", out, parse_size("8KB"), workers=1, environ={"RANK": "0", "WORLD_SIZE": "2"})
    assert second == json.loads((packed / "shards" / "manifest.json").read_text())
    with pytest.raises(UserError, match="RANK=2 WORLD_SIZE=2"):
        pack(packed / "folder", out, 1000, environ={"RANK": "2", "WORLD_SIZE": "2"})


def test_pack_as_two_concurrent_job_tasks_ends_with_one_manifest(packed: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "nodescale", "data", "pack", str(packed / "folder"), "--out", "out",
               "--shard-size", "8KB", "--workers", "1"]
    tasks = [subprocess.Popen(command, cwd=tmp_path, env={**cli_env(), "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [task.communicate(timeout=120) for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == json.loads(
        (packed / "shards" / "manifest.json").read_text())


def test_shard_plan_cuts_by_size_and_keeps_every_sample() -> None:
    assert plan_shards(np.array([1000, 1000, 1000, 5000, 10]), 6000) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert parse_size("1GB") == 10**9 and parse_size("256MiB") == 256 * 2**20 and parse_size("4096") == 4096


@given(st.text(max_size=12))
def test_shard_size_is_a_size_or_a_user_error(text: str) -> None:
    try:
        assert parse_size(text) >= 1
    except UserError as err:
        assert "--shard-size" in str(err)


def test_brace_lists_and_globs_name_the_shards(packed: Path) -> None:
    assert expand_braces("d/t-{08..10}.tar") == ["d/t-08.tar", "d/t-09.tar", "d/t-10.tar"]
    assert expand_braces("{a,b}-{0..1}") == ["a-0", "a-1", "b-0", "b-1"]
    shards = packed / "shards"
    assert find_shards(str(shards / "train-{000000..000001}.tar")) == [
        str(shards / "train-000000.tar"), str(shards / "train-000001.tar")]
    assert len(load(str(shards / "train-*.tar"), val_dir=shards / "val-*.tar").train) == 24
    with pytest.raises(UserError, match="train-000098.tar: does not exist"):
        find_shards(str(shards / "train-{000098..000099}.tar"))


def test_cli_data_help_pack_and_inspect(packed: Path) -> None:
    assert "pack" in run_cli(["data", "--help"], cwd=packed).stdout
    text = run_cli(["data", "inspect", "shards"], cwd=packed).stdout
    assert "format   shards" in text and "train    24 samples in" in text and "classes  3 (ant, bee, cow)" in text
    assert "imagefolder" in run_cli(["data", "inspect", "folder"], cwd=packed).stdout
    bad = run_cli(["data", "pack", "folder", "--out", "x", "--shard-size", "big"], cwd=packed, check=False)
    assert bad.returncode == 2 and "--shard-size 'big'" in bad.stderr and "Traceback" not in bad.stderr
    missing = run_cli(["data", "pack", "nowhere", "--out", "x"], cwd=packed, check=False)
    assert missing.returncode == 2 and "source nowhere: does not exist" in missing.stderr


# ---------------------------------------------------------------- order and resume, without processes


def test_loader_on_shards_resumes_mid_epoch_exactly(packed: Path) -> None:
    dataset = load(packed / "shards").train

    def loader(rank: int) -> EpochLoader:
        plan = ShardPlan(len(dataset), 2, rank, 3, 7, True, dataset.sample_groups)
        return EpochLoader(dataset, plan, pad=True, drop_last=False, grad_accum=1, device=torch.device("cpu"))

    def drawn(batches: EpochLoader) -> list[list[float]]:  # each image's pixel sum names it
        return [x.flatten(1).sum(1).tolist() for x, _ in batches]

    whole = [drawn(loader(rank)) for rank in range(2)]
    for rank in range(2):
        first = loader(rank)
        iterator = iter(first)
        for _ in range(2):
            next(iterator)
        again = loader(rank)
        again.load_state_dict(first.state_dict())
        assert drawn(again) == whole[rank][2:]
    other = EpochLoader(dataset, ShardPlan(len(dataset), 1, 0, 6, 7, True, dataset.sample_groups), pad=True,
                        drop_last=False, grad_accum=1, device=torch.device("cpu"))
    with pytest.warns(UserWarning, match="start of epoch 1"):  # pieces are per rank: not across world sizes
        other.load_state_dict(first.state_dict())


# ---------------------------------------------------------------- bad input


def test_truncated_shard_stops_or_is_skipped_as_weight_zero_samples(packed: Path, tmp_path: Path) -> None:
    shutil.copytree(packed / "shards", tmp_path / "s")
    victim = tmp_path / "s" / "train-000001.tar"
    victim.write_bytes(victim.read_bytes()[:1500])  # inside the first sample's data
    with pytest.raises(UserError, match=f"shard {victim}: is truncated"):
        load(tmp_path / "s")
    with pytest.warns(UserWarning, match="train-000001.tar"):
        splits = load(tmp_path / "s", skip_bad_samples=True)
    lost = json.loads((tmp_path / "s" / "manifest.json").read_text())["splits"]["train"]["shards"][1]["samples"]
    assert len(splits.train) == 24 and len(splits.train.unreadable) == lost


def test_corrupt_tar_names_the_file_and_exits_2(packed: Path, tmp_path: Path) -> None:
    shutil.copytree(packed / "shards", tmp_path / "s")
    victim = tmp_path / "s" / "train-000000.tar"
    data = bytearray(victim.read_bytes())
    data[0:100] = b"\x07" * 100  # the first header's name and checksum
    victim.write_bytes(bytes(data))
    result = run_cli(["train", "--dataset", "shards", "--data-dir", "s", "--nproc", "1", "--max-steps", "1", *SGD],
                     cwd=tmp_path, check=False)
    assert result.returncode == 2 and f"shard {victim}: is not a readable tar archive" in result.stderr
    assert "Traceback" not in result.stderr


def test_sample_without_a_label_names_the_file_and_the_key(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with tarfile.open(tmp_path / "d" / "train-000000.tar", "w") as tar:
        add(tar, "a/k1.npy", _npy(np.zeros((1, 4, 4), np.uint8)))
        add(tar, "a/k1.json", json.dumps({"cls": 1}).encode())
        add(tar, "a/k2.npy", _npy(np.zeros((1, 4, 4), np.uint8)))
    with pytest.raises(UserError, match=r"train-000000.tar, sample a/k2: has no label"):
        load(tmp_path / "d")


@pytest.mark.parametrize("member", ["k2.cls", "k2.json"])
def test_a_label_past_64_bits_names_the_sample_and_the_rule(tmp_path: Path, member: str) -> None:
    """A 23-digit class passed the index and then stopped the ranks with OverflowError (issue 36)."""
    (tmp_path / "d").mkdir()
    label = "1" + "0" * 22
    with tarfile.open(tmp_path / "d" / "train-000000.tar", "w") as tar:
        add(tar, "k1.npy", _npy(np.zeros((1, 4, 4), np.uint8)))
        add(tar, "k1.cls", b"0")
        add(tar, "k2.npy", _npy(np.zeros((1, 4, 4), np.uint8)))
        add(tar, member, label.encode() if member.endswith(".cls") else json.dumps({"cls": int(label)}).encode())
    with pytest.raises(UserError, match=rf"train-000000.tar, sample k2: has an unreadable label in {member} "
                                        rf"\({label} does not fit in 64 bits"):
        load(tmp_path / "d")


def test_any_tar_names_and_json_labels_with_validation_held_out_by_the_seed(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    for number in range(2):
        with tarfile.open(tmp_path / "d" / f"part{number}.tar", "w") as tar:
            for key in range(5):
                add(tar, f"s{number}{key}.npy", _npy(np.full((2, 3), key, np.float32)))
                add(tar, f"s{number}{key}.json", json.dumps({"label": key % 2, "note": "x"}).encode())
    splits = load(tmp_path / "d", val_fraction=0.2)
    assert (len(splits.train), len(splits.val), splits.spec.shape, splits.spec.num_classes) == (8, 2, (2, 3), 2)
    assert sorted(splits.train.sample_groups) == [4, 4] or sorted(splits.train.sample_groups) == [3, 5]
    samples = [splits.train[i] for i in range(8)] + [splits.val[i] for i in range(2)]
    assert all(int(y) == int(x[0, 0]) % 2 for x, y in samples) and sum(int(y) for _, y in samples) == 4


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


# ---------------------------------------------------------------- staging


def test_stage_copies_a_ranks_shards_once_and_checks_them(packed: Path, tmp_path: Path) -> None:
    dataset = load(packed / "shards", stage=tmp_path / "local").train
    plan = ShardPlan(len(dataset), 2, 1, 4, 0, True, dataset.sample_groups)
    dataset.stage_shards(plan)
    copies = sorted((tmp_path / "local").rglob("*.tar"))
    mine = {dataset.columns["shard"][i] for i in plan.padded(0)[1::2].tolist()}
    assert len(copies) == len(mine) < len(dataset.sample_groups)
    assert all(dataset.paths[s].startswith(str(tmp_path / "local")) for s in mine)
    assert [dataset[i][1] for i in range(len(dataset))] == [load(packed / "shards").train[i][1]
                                                             for i in range(len(dataset))]
    stamps = [c.stat().st_mtime_ns for c in copies]
    again = load(packed / "shards", stage=tmp_path / "local").train
    again.stage_shards(plan)  # already there with the same checksum: not copied again
    assert [c.stat().st_mtime_ns for c in copies] == stamps
    original = copies[0].read_bytes()
    copies[0].write_bytes(original[:600] + bytes([original[600] ^ 1]) + original[601:])
    again.stage_shards(plan)  # the same size but another checksum: copied again
    assert copies[0].read_bytes() == original
    again.checksums = dict.fromkeys(again.checksums, "0" * 64)
    copies[0].write_bytes(b"changed")
    with pytest.raises(UserError, match="the manifest says 0000"):
        again.stage_shards(plan)


# ---------------------------------------------------------------- training runs


def test_packed_folder_trains_to_the_folders_weights_in_sequential_order(packed: Path) -> None:
    runs = {}
    for name, where in (("imagefolder", "folder"), ("shards", "shards")):
        run_cli(["train", "--dataset", name, "--data-dir", where, "--nproc", "1", "--max-steps", "8",
                 "--set", "data.order=sequential", "--out", f"run-{name}", *SGD], cwd=packed)
        runs[name] = final_weights(packed / f"run-{name}")
    assert max_difference(runs["imagefolder"], runs["shards"]) == 0.0


def test_two_ranks_on_shards_resume_mid_epoch_as_if_never_stopped(packed: Path, tmp_path: Path) -> None:
    # 24 samples, 2 ranks x 4: 3 steps an epoch; the checkpoint at step 4 is mid-epoch 1.
    args = ["train", "--dataset", "shards", "--data-dir", str(packed / "shards"), "--nproc", "2", "--max-steps", "6",
            "--checkpoint-every", "4", *SGD]
    run_cli([*args, "--out", "whole", "--stage", "local"], cwd=tmp_path)  # staged: the same samples
    assert read_summary(tmp_path / "whole")["world_size"] == 2
    shards = len(json.loads((packed / "shards" / "manifest.json").read_text())["splits"]["train"]["shards"])
    assert 0 < len(list((tmp_path / "local").rglob("train-*.tar"))) <= shards
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    for saved in (tmp_path / "whole" / "checkpoints").glob("step-00000004*"):
        (shutil.copytree if saved.is_dir() else shutil.copy)(saved, tmp_path / "resumed" / "checkpoints" / saved.name)
    result = run_cli([*args, "--out", "resumed", "--resume"], cwd=tmp_path)
    assert "(step 4)" in result.stdout
    assert max_difference(final_weights(tmp_path / "resumed"), final_weights(tmp_path / "whole")) == 0.0
