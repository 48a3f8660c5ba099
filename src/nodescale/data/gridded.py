"""Named variables of a Zarr store or a netCDF file, cut into windows along named dimensions (regression).

``--dataset zarr --data-dir STORE`` with ``data.inputs``, ``data.targets`` and ``data.window``:

* STORE is a Zarr store (a directory with ``zarr.json`` or ``.zgroup``, read with the zarr library) or
  a netCDF file (read through xarray). The variables named must share their dimensions (same names,
  same order, same sizes), as the gridded fields of one dataset do, and hold numbers.
* Along each dimension in ``data.window`` a sample is ``window`` elements long, windows starting every
  ``stride`` elements (default: ``window``, so windows do not overlap); windows start at element 0 and
  a tail shorter than a window is left out. Dimensions not named are taken whole.
* A sample is ``(x, y)``: each variable's window in its own dimension order, the dimensions before its
  last two folded into channels, the input variables' channels one after another in ``x``, the
  targets' in ``y`` (a float32 ``(C, H, W)``; ``(C, L)`` for one-dimensional variables).
* Validation holds out the last ``data.val_fraction`` of the windows along the first dimension with
  two windows or more (the latest times, for ``(time, lat, lon)`` data), in whole blocks where it can.

Chunk-aware reading: samples are numbered block by block, a block being the windows that start in one
stretch of ``lcm(stride, chunk of every variable)`` elements along each dimension. The dataset's
``sample_groups`` are the blocks, which ``ShardPlan`` orders (blocks in a seeded order, then samples
inside each) and deals to ranks in contiguous runs; the dataset reads a whole block of every variable
when its first sample is asked for and keeps it for the next ones. With windows no longer than their
stride a block covers whole chunks, so a rank reads no chunk twice per epoch (overlapping windows
read the chunks at a block's edge twice).

Samples are read by ``WindowDataset`` (``nodescale.data.gridded_dataset``), which ``load`` imports:
this module stays free of torch for the launcher's ``check``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from nodescale.data.base import DatasetSplits
from nodescale.data.grid import Grid, block_bytes, split_grids
from nodescale.data.gridded_stats import variable_stats
from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from nodescale.data.section import DataSection

INSTALL = "pip install 'nodescale[science]'"
# A block bigger than this (all variables, as float32) is not kept in memory: samples are read one by one.
BLOCK_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class Variable:
    """One array of the store: its dimensions, and the stretch of elements read together along each."""

    name: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]  # Zarr's shard (or chunk); 1 where a netCDF variable is stored contiguous

    def describe(self) -> str:
        return f"{self.name} ({', '.join(self.dims)}) {'x'.join(map(str, self.shape))} {self.dtype}"


def _zarr() -> Any:
    try:
        import zarr
    except ImportError as err:
        raise UserError("dataset 'zarr'", "needs the zarr package to read a Zarr store", INSTALL) from err
    return zarr


def locate(cfg: DataSection) -> tuple[Path, str]:
    """The store and how to read it: ``"zarr"`` for a Zarr directory, ``"netcdf"`` for a file."""
    if cfg.dir is None:
        raise UserError("dataset 'zarr'", "needs its store", "pass --data-dir STORE.zarr (or FILE.nc)")
    path = Path(cfg.dir).expanduser()
    if path.is_dir():
        if not any((path / marker).is_file() for marker in ("zarr.json", ".zgroup", ".zarray")):
            raise UserError(f"data directory {path}", "is not a Zarr store (it has no zarr.json or .zgroup)",
                            "pass the store's directory, or a netCDF file")
        return path, "zarr"
    if not path.is_file():
        raise UserError(f"store {path}", "does not exist", "pass --data-dir STORE.zarr (or FILE.nc)")
    return path, "netcdf"


def open_store(path: Path | str, kind: str) -> Any:
    """The Zarr group or the xarray dataset at ``path``, read-only and lazy."""
    if kind == "zarr":
        zarr = _zarr()
        try:
            return zarr.open_group(str(path), mode="r")
        except Exception as err:  # an array rather than a group, unreadable metadata, ...
            raise UserError(f"Zarr store {path}", f"does not open as a group of variables ({err})",
                            "pass a group holding named arrays (what xarray's to_zarr writes)") from None
    try:
        import xarray
    except ImportError as err:
        raise UserError("dataset 'zarr' with a netCDF file", "needs xarray (and netCDF4)", INSTALL) from err
    try:
        return xarray.open_dataset(path, cache=False, decode_times=False)
    except (ValueError, OSError) as err:  # no backend reads it (netCDF4 missing), or not netCDF at all
        raise UserError(f"{path}", f"does not open as netCDF through xarray ({str(err).splitlines()[0]})",
                        f"pass a netCDF file or a Zarr store; for netCDF-4 files: {INSTALL}") from None


def variables(store: Any, kind: str) -> dict[str, Variable]:
    """Every variable of the store by name."""
    found = {}
    if kind == "zarr":
        for name, array in store.arrays():
            dims = getattr(array.metadata, "dimension_names", None) or array.attrs.get("_ARRAY_DIMENSIONS")
            dims = tuple(dims) if dims else tuple(f"dim_{i}" for i in range(array.ndim))
            unit = getattr(array, "shards", None) or array.chunks  # a shard is one object in the store
            found[name] = Variable(name, dims, tuple(array.shape), np.dtype(array.dtype), tuple(unit))
    else:
        for name, var in store.variables.items():
            chunks = var.encoding.get("chunksizes") or (1,) * var.ndim
            found[str(name)] = Variable(str(name), tuple(map(str, var.dims)), tuple(var.shape), var.dtype,
                                        tuple(chunks))
    return found


def handle(store: Any, kind: str, name: str) -> Any:
    """Variable ``name`` of the store, to ``read`` from (a Zarr array's metadata is read here, once)."""
    return store[name] if kind == "zarr" else store.variables[name]


def read(variable: Any, kind: str, region: tuple[slice, ...]) -> np.ndarray:
    """The elements of a ``handle`` in ``region``, as float32."""
    data = variable[region] if kind == "zarr" else variable[region].values
    return np.asarray(data, dtype=np.float32)


@dataclass(frozen=True)
class Layout:
    """What ``check`` found: the variables and the training and validation windows."""

    path: Path
    kind: str
    inputs: tuple[Variable, ...]
    targets: tuple[Variable, ...]
    train: Grid
    val: Grid
    whole_blocks: bool  # blocks small enough to keep in memory

    def spec(self) -> InputSpec:
        """The shape of ``x`` and the channels of ``y`` (their last dimensions are ``x``'s)."""
        window = self.train.window
        folded = math.prod(window[:-2]) if len(window) > 1 else 1
        x_shape = (len(self.inputs) * folded, *window[-2:])
        return InputSpec(x_shape, len(self.targets) * folded, "regression")


def _chosen(found: dict[str, Variable], names: list[str], key: str, path: Path) -> tuple[Variable, ...]:
    if not names:
        raise UserError(f"dataset 'zarr' without data.{key}", f"needs the {key} variables by name",
                        f"e.g. --set data.{key}=t2m,u10; {path} holds {_listing(found)}")
    for name in names:
        if name not in found:
            raise UserError(f"data.{key} variable {name!r}", f"is not in {path}; it holds {_listing(found)}",
                            f"set data.{key} to variables of the store")
        if found[name].dtype.kind not in "biuf":
            raise UserError(f"variable {name!r} of {path}", f"holds {found[name].dtype}, not numbers",
                            "choose numeric variables (integers or floats)")
        if not found[name].dims:
            raise UserError(f"variable {name!r} of {path}", "is a single value, with no dimension to window",
                            "choose gridded variables")
    return tuple(found[name] for name in names)


def _listing(found: dict[str, Variable]) -> str:
    shown = [var.describe() for var in list(found.values())[:20]]
    return "; ".join(shown) + (f" and {len(found) - 20} more" if len(found) > 20 else "") if shown else "no variables"


def _sizes(given: dict[str, int], dims: tuple[str, ...], key: str, first: Variable) -> None:
    for dim in given:
        if dim not in dims:
            raise UserError(f"data.{key} dimension {dim!r}", f"is not a dimension of {first.name}: it has "
                            f"({', '.join(dims)})", f"name dimensions of the variables in data.{key}")


def inspect(cfg: DataSection) -> Layout:
    """Open the store and check the configuration against it (no data read): ``UserError`` on a mismatch."""
    path, kind = locate(cfg)
    store = open_store(path, kind)
    try:
        found = variables(store, kind)
    finally:
        if kind == "netcdf":
            store.close()
    inputs = _chosen(found, cfg.inputs, "inputs", path)
    targets = _chosen(found, cfg.targets, "targets", path)
    first = inputs[0]
    for var in (*inputs, *targets)[1:]:
        if (var.dims, var.shape) != (first.dims, first.shape):
            raise UserError(f"variables {first.name} and {var.name} of {path}",
                            f"differ in dimensions: {first.describe()}, but {var.describe()}",
                            "choose inputs and targets on one grid")
    chosen = {var.name for var in (*inputs, *targets)}
    for name in cfg.stats:
        if name not in chosen:
            raise UserError(f"data.stats variable {name!r}", "is neither an input nor a target "
                            f"({', '.join(sorted(chosen))})", "give figures for the variables of data.inputs and "
                            "data.targets")
    _sizes(cfg.window, first.dims, "window", first)
    _sizes(cfg.stride, first.dims, "stride", first)
    for dim in cfg.stride:
        if dim not in cfg.window:
            raise UserError(f"data.stride {dim}:{cfg.stride[dim]}", f"is along {dim!r}, which data.window does not "
                            "name (a dimension not in the window is taken whole)", f"add {dim} to data.window")
    window = tuple(cfg.window.get(dim, size) for dim, size in zip(first.dims, first.shape, strict=True))
    for dim, size, length in zip(first.dims, first.shape, window, strict=True):
        if length > size:
            raise UserError(f"data.window {dim}:{length}", f"is larger than the array: {dim} has {size} elements "
                            f"in {path}", f"make the window along {dim} at most {size}")
    stride = tuple(cfg.stride.get(dim, length) for dim, length in zip(first.dims, window, strict=True))
    chunks = [tuple(var.chunks[d] for var in (*inputs, *targets)) for d in range(len(first.dims))]
    train, val = split_grids(first.dims, first.shape, window, stride, chunks, cfg.val_fraction, str(path))
    whole = block_bytes(train, len(inputs) + len(targets)) <= BLOCK_BYTES
    return Layout(path, kind, inputs, targets, train, val, whole)


class GriddedFormat:
    """Windows of named variables of a Zarr store or netCDF file, for regression."""

    name = "zarr"
    needs_dir = True

    def check(self, cfg: DataSection) -> None:
        """The store opens and holds the variables, dimensions and room for the windows asked for."""
        inspect(cfg)

    def prepare(self, cfg: DataSection) -> None:
        """With ``data.normalise=train``: the variables' mean and std over the training split, cached."""
        if cfg.normalise == "train":
            variable_stats(inspect(cfg), cfg.stats, write_cache=True)

    def load(self, cfg: DataSection, seed: int) -> DatasetSplits:
        """Both sets; their split depends on the configuration only (``seed`` is not needed)."""
        from nodescale.data.gridded_dataset import WindowDataset

        layout = inspect(cfg)
        scale = None
        if cfg.normalise == "train":
            stats = variable_stats(layout, cfg.stats, write_cache=False)
            scale = [stats[var.name] for var in (*layout.inputs, *layout.targets)]
        return DatasetSplits(WindowDataset(layout, layout.train, scale), WindowDataset(layout, layout.val, scale),
                             layout.spec())


FORMAT = GriddedFormat()
