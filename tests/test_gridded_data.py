"""The zarr format: windows of named variables of a Zarr store or netCDF file, read chunk by chunk.

The store and file are made here: t2m and u10 on a (time 24, lat 16, lon 16) grid in chunks of
(4, 8, 8), and tp = 0.5 t2m - 0.3 u10, which gridconv learns. Windows of (2, 8, 8) put two samples
in each chunk; validation is the last block along time (8 samples), training the other 40.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import xarray
import zarr

from conftest import cli_env, final_weights, max_difference, read_summary
from nodescale.cli.main import main
from nodescale.data import gridded, gridded_stats
from nodescale.data.grid import split_grids
from nodescale.data.registry import get_format
from nodescale.data.section import DataSection
from nodescale.errors import UserError

DIMS = ("time", "lat", "lon")
CHUNKS = (4, 8, 8)
OPTIONS = ["--set", "data.inputs=t2m,u10", "--set", "data.targets=tp", "--set", "data.window=time:2,lat:8,lon:8"]


@pytest.fixture(scope="module")
def fields() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    t2m, u10 = (rng.standard_normal((24, 16, 16)).astype("f4") for _ in range(2))
    return {"t2m": t2m, "u10": u10, "tp": 0.5 * t2m - 0.3 * u10}


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, fields: dict[str, np.ndarray]) -> dict[str, Path]:
    """The same fields as a Zarr store and as a netCDF-4 file (with a text and a 2-D variable besides)."""
    root = tmp_path_factory.mktemp("gridded")
    group = zarr.open_group(root / "era.zarr", mode="w")
    for name, values in fields.items():
        group.create_array(name, shape=values.shape, chunks=CHUNKS, dtype="f4", dimension_names=DIMS)[:] = values
    dataset = xarray.Dataset({name: (DIMS, values) for name, values in fields.items()})
    dataset["station"] = ("time", np.array([f"s{i}" for i in range(24)]))
    dataset["orography"] = (("lat", "lon"), np.zeros((16, 16), "f4"))
    dataset.to_netcdf(root / "era.nc", encoding={name: {"chunksizes": CHUNKS} for name in fields})
    # As xarray writes Zarr version 2 (dimension names in the _ARRAY_DIMENSIONS attribute).
    dataset[list(fields)].to_zarr(root / "v2.zarr", zarr_format=2, consolidated=False,
                                  encoding={name: {"chunks": CHUNKS} for name in fields})
    return {"zarr": root / "era.zarr", "netcdf": root / "era.nc", "zarr_v2": root / "v2.zarr"}


def config(path: Path, **fields: object) -> DataSection:
    settings = {"inputs": "t2m,u10", "targets": "tp", "window": "time:2,lat:8,lon:8", **fields}
    return DataSection(name="zarr", dir=path, **settings)


def test_windows_are_numbered_block_by_block_and_blocks_hold_whole_chunks() -> None:
    for window, stride in (((2, 8, 8), (2, 8, 8)), ((3, 5, 8), (3, 5, 8)), ((4, 8, 8), (2, 8, 8))):
        chunks = [(c,) for c in CHUNKS]
        train, val = split_grids(DIMS, (24, 16, 16), window, stride, chunks, 0.2, "test")
        starts = []
        for grid in (train, val):
            for index in range(len(grid)):
                block, positions = grid.locate(index)
                inner, outer = grid.window_region(positions), grid.block_region(block)
                assert all(o.start <= i.start and i.stop <= o.stop for i, o in zip(inner, outer, strict=True))
                starts.append(tuple(s.start for s in inner))
            assert sum(grid.block_sizes) == len(grid)
            # Blocks start on chunk boundaries (the validation part too): no chunk is shared by two blocks
            # where windows do not overlap.
            assert all(s.start % c == 0 for b in range(len(grid.block_sizes))
                       for s, c in zip(grid.block_region(b), CHUNKS, strict=True))
        expected = {(t * stride[0], y * stride[1], x * stride[2]) for t in range((24 - window[0]) // stride[0] + 1)
                    for y in range((16 - window[1]) // stride[1] + 1) for x in range((16 - window[2]) // stride[2] + 1)}
        assert len(starts) == len(set(starts)) and set(starts) == expected  # every window, once
        assert min(s[0] for s in starts[len(train):]) > max(s[0] for s in starts[:len(train)])  # val: the latest


@pytest.mark.parametrize("kind,whole_blocks", [("zarr", True), ("netcdf", True), ("zarr_v2", True),
                                               ("zarr", False)])
def test_samples_are_the_windows_of_the_store(stores: dict[str, Path], fields: dict[str, np.ndarray],
                                              kind: str, whole_blocks: bool, monkeypatch) -> None:
    if not whole_blocks:  # blocks too big to keep: each window read alone
        monkeypatch.setattr(gridded, "BLOCK_BYTES", 0)
    splits = get_format("zarr").load(config(stores[kind]), seed=0)
    assert splits.train.layout.whole_blocks == whole_blocks
    assert (len(splits.train), len(splits.val)) == (40, 8)
    # Two times of two inputs, and of one target, as channels.
    assert splits.spec.shape == (4, 8, 8) and splits.spec.num_classes == 2 and splits.spec.task == "regression"
    assert splits.train.sample_groups == (2,) * 20  # two windows in each chunk
    for dataset in (splits.train, splits.val):
        for index in (0, 1, 7, len(dataset) - 1):
            x, y = dataset[index]
            t, lat, lon = (s.start for s in dataset.grid.window_region(dataset.grid.locate(index)[1]))
            cut = np.s_[t:t + 2, lat:lat + 8, lon:lon + 8]
            np.testing.assert_array_equal(x.numpy(), np.concatenate([fields["t2m"][cut], fields["u10"][cut]]))
            np.testing.assert_array_equal(y.numpy(), fields["tp"][cut])


@pytest.mark.parametrize("kind", ["zarr", "netcdf"])
def test_gridconv_learns_from_the_store(stores: dict[str, Path], tmp_path: Path, kind: str) -> None:
    assert main(["train", "--dataset", "zarr", "--data-dir", str(stores[kind]), "--model", "gridconv", *OPTIONS,
                 "--strategy", "single", "--epochs", "4", "--batch-size", "8", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 0
    summary = read_summary(tmp_path / "run")
    assert summary["val_samples"] == 8
    assert summary["val_loss"] < 0.15  # predicting 0 costs var(tp) = 0.34


def test_resume_mid_epoch_ends_with_the_same_weights(stores: dict[str, Path], tmp_path: Path) -> None:
    # 5 steps an epoch: the step-7 checkpoint is in the middle of the second.
    args = ["train", "--dataset", "zarr", "--data-dir", str(stores["zarr"]), "--model", "gridconv", *OPTIONS,
            "--strategy", "single", "--epochs", "3", "--batch-size", "8", "--checkpoint-every", "7",
            "--keep-last", "3", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "full")]) == 0
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    for saved in (tmp_path / "full/checkpoints").glob("step-00000007*"):
        shutil.copy(saved, tmp_path / "resumed/checkpoints/")
    assert main([*args, "--out", str(tmp_path / "resumed"), "--resume"]) == 0
    assert max_difference(final_weights(tmp_path / "full"), final_weights(tmp_path / "resumed")) == 0.0


# Logs each chunk file a process opens, with its rank: Python's audit hook sees every open, zarr's too.
CHUNK_LOG = """
import os, sys
def _log(event, args):
    if event == "open" and isinstance(args[0], str) and "/c/" in args[0] and args[0].startswith(os.environ["STORE"]):
        with open(os.path.join(os.environ["CHUNK_LOG"], str(os.getpid())), "a") as log:
            log.write(os.environ.get("RANK", "launcher") + " " + args[0] + "\\n")
sys.addaudithook(_log)
"""


def test_two_ranks_read_each_chunk_once_an_epoch_and_train_on_every_sample(stores: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    hook, log = tmp_path / "hook", tmp_path / "log"
    hook.mkdir(), log.mkdir()
    (hook / "sitecustomize.py").write_text(CHUNK_LOG)
    env = {**cli_env(), "STORE": str(stores["zarr"]), "CHUNK_LOG": str(log)}
    env["PYTHONPATH"] = f"{hook}:{env.get('PYTHONPATH', '')}"
    run = subprocess.run([sys.executable, "-m", "nodescale", "train", "--dataset", "zarr", "--data-dir",
                          str(stores["zarr"]), "--model", "gridconv", *OPTIONS, "--nproc", "2", "--epochs", "1",
                          "--batch-size", "4", "--set", "train.timing_warmup_steps=0", "--no-progress",
                          "--out", "run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    reads: dict[str, list[str]] = {}
    for line in "".join(f.read_text() for f in log.iterdir()).splitlines():
        rank, path = line.split(" ", 1)
        reads.setdefault(rank, []).append(path)
    assert sorted(reads) == ["0", "1"]  # only the ranks read chunks (the launcher's check reads metadata)
    for rank, paths in reads.items():
        twice = [path for path, n in Counter(paths).items() if n > 1]
        assert not twice, f"rank {rank} read chunks twice in one epoch: {twice}"
    train_chunks = {str(stores["zarr"] / f"{v}/c/{t}/{y}/{x}") for v in ("t2m", "u10", "tp")
                    for t in range(5) for y in range(2) for x in range(2)}
    read = {path for paths in reads.values() for path in paths}
    assert train_chunks <= read and len(read) == 72  # every training chunk, and the validation time chunk
    summary = read_summary(tmp_path / "run")
    assert summary["timed_samples"] == 40 and summary["val_samples"] == 8  # every sample of each, counted once


BAD = {  # what changes in the configuration: what the message says
    "missing_variable": ({"inputs": "t2m,sst"}, ["data.inputs variable 'sst'", "is not in", "era.", "it holds",
                                                 "t2m (time, lat, lon) 24x16x16 float32"]),
    "window_too_large": ({"window": "time:30,lat:8"}, ["data.window time:30", "larger than the array",
                                                       "time has 24 elements", "at most 24"]),
    "unknown_dimension": ({"window": "level:2"}, ["data.window dimension 'level'", "(time, lat, lon)"]),
    "stride_off_window": ({"window": "time:2", "stride": "lat:2"}, ["data.stride lat:2", "add lat to data.window"]),
    "no_targets": ({"targets": ""}, ["without data.targets", "e.g. --set data.targets="]),
    "one_window": ({"window": "time:24,lat:16,lon:16"}, ["fit only once", "leaving none to validate"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_configurations_name_the_store_and_the_fix(stores: dict[str, Path], case: str) -> None:
    change, words = BAD[case]
    with pytest.raises(UserError) as err:
        get_format("zarr").check(config(stores["zarr"], **change))
    for word in words:
        assert word in str(err.value)


def test_netcdf_variables_that_are_text_or_on_another_grid_are_refused(stores: dict[str, Path]) -> None:
    with pytest.raises(UserError, match="variable 'station' of .*era.nc: holds .*, not numbers"):
        get_format("zarr").check(config(stores["netcdf"], inputs="t2m,station"))
    with pytest.raises(UserError, match=r"differ in dimensions: t2m \(time, lat, lon\).*orography \(lat, lon\)"):
        get_format("zarr").check(config(stores["netcdf"], inputs="t2m,orography"))


def test_the_cli_exits_2_naming_the_missing_variable(stores: dict[str, Path], tmp_path: Path, capsys) -> None:
    code = main(["train", "--dataset", "zarr", "--data-dir", str(stores["zarr"]), "--model", "gridconv", *OPTIONS,
                 "--set", "data.targets=precip", "--strategy", "single", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "variable 'precip'" in err and str(stores["zarr"]) in err and "Traceback" not in err
    assert main(["train", "--dataset", "zarr", "--set", "data.window=time", "--out", str(tmp_path / "w")]) == 2
    assert "must be DIMENSION:SIZE pairs" in capsys.readouterr().err


def test_a_directory_that_is_no_store_and_a_missing_library_say_what_to_do(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(UserError, match="is not a Zarr store"):
        get_format("zarr").check(config(tmp_path))
    (tmp_path / "zarr.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "zarr", None)  # as if it were not installed
    with pytest.raises(UserError, match=r"(?s)needs the zarr package.*pip install 'nodescale\[science\]'"):
        get_format("zarr").check(config(tmp_path))


# ---------------------------------------------------------------- normalisation


@pytest.mark.parametrize("kind", ["zarr", "netcdf"])
def test_normalise_train_standardises_each_variable_by_its_training_split(
        stores: dict[str, Path], fields: dict[str, np.ndarray], kind: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("NODESCALE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gridded_stats, "SLAB_BYTES", 1)  # one chunk (4 times) a slab: five slabs combined
    cfg = config(stores[kind], normalise="train")
    get_format("zarr").prepare(cfg)  # once per node: computed and cached
    monkeypatch.setattr(gridded_stats, "compute", None)  # the ranks read the cache
    splits = get_format("zarr").load(cfg, seed=0)
    train = np.s_[0:20]  # the validation block (times 20-23) is left out
    figures = {name: (values[train].astype("f8").mean(), values[train].astype("f8").std())
               for name, values in fields.items()}
    assert splits.train.scale == [pytest.approx(figures[n], rel=1e-9) for n in ("t2m", "u10", "tp")]
    for dataset in (splits.train, splits.val):
        x, y = dataset[len(dataset) - 1]
        t, lat, lon = (s.start for s in dataset.grid.window_region(dataset.grid.locate(len(dataset) - 1)[1]))
        cut = np.s_[t:t + 2, lat:lat + 8, lon:lon + 8]
        (mt, st), (mu, su), (mp, sp) = (figures[n] for n in ("t2m", "u10", "tp"))
        np.testing.assert_allclose(x.numpy(), np.concatenate([(fields["t2m"][cut] - mt) / st,
                                                              (fields["u10"][cut] - mu) / su]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(y.numpy(), (fields["tp"][cut] - mp) / sp, rtol=1e-5, atol=1e-6)


def test_given_stats_are_used_without_reading_and_bad_ones_are_refused(stores: dict[str, Path], tmp_path: Path,
                                                                      monkeypatch) -> None:
    monkeypatch.setenv("NODESCALE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gridded_stats, "compute", None)
    cfg = config(stores["zarr"], normalise="train", stats="t2m:1:2, u10:0:0.5,tp:-1:4")
    fmt = get_format("zarr")
    fmt.prepare(cfg)
    assert fmt.load(cfg, seed=0).train.scale == [(1.0, 2.0), (0.0, 0.5), (-1.0, 4.0)]
    with pytest.raises(UserError, match="data.stats variable 'sst': is neither an input nor a target"):
        fmt.check(config(stores["zarr"], stats="sst:0:1"))
    for bad, words in (("t2m:1", "must be VARIABLE:MEAN:STD"), ("t2m:0:0", "a positive, finite std"),
                       ("t2m:x:1", "must be VARIABLE:MEAN:STD")):
        with pytest.raises(UserError, match=words):
            config(stores["zarr"], stats=bad)


def test_a_constant_variable_cannot_be_standardised(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("NODESCALE_CACHE_DIR", str(tmp_path / "cache"))
    group = zarr.open_group(tmp_path / "c.zarr", mode="w")
    for name, values in (("land", np.ones((8, 4, 4), "f4")), ("t", np.arange(128, dtype="f4").reshape(8, 4, 4))):
        group.create_array(name, shape=values.shape, chunks=(4, 4, 4), dtype="f4", dimension_names=DIMS)[:] = values
    cfg = config(tmp_path / "c.zarr", inputs="land,t", targets="t", window="time:2", normalise="train")
    with pytest.raises(UserError, match=r"(?s)variable .land. of .*c.zarr: is constant .* data.stats=land:MEAN:STD"):
        get_format("zarr").prepare(cfg)
