"""Per-variable mean and standard deviation of a Zarr/netCDF store over its training split (``data.normalise=train``).

Read once per node (``GriddedFormat.prepare``), in slabs of whole chunks along the first dimension
(every other dimension whole), so each chunk is read once and a slab stays under ``SLAB_BYTES``;
combined per slab with Chan's parallel formula in float64 (NaNs, masked land or sea, left out).
The result is cached by the store, the variables and the region; ``load`` reads the cache.
``data.stats`` gives the figures instead, for variables it names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import TYPE_CHECKING

import numpy as np

from nodescale.atomic_files import write_json_atomic
from nodescale.data.cache_location import cache_dir
from nodescale.errors import UserError

if TYPE_CHECKING:
    from nodescale.data.gridded import Layout

log = logging.getLogger(__name__)
SLAB_BYTES = 256 * 1024**2
Stats = dict[str, tuple[float, float]]


def training_region(layout: Layout) -> tuple[slice, ...]:
    """The elements that the training windows cover, along each dimension."""
    grid = layout.train
    return tuple(slice(f * s, (f + n - 1) * s + w) for f, n, s, w in
                 zip(grid.first, grid.count, grid.stride, grid.window, strict=True))


def _slabs(region: tuple[slice, ...], chunk: int, row_bytes: int) -> list[tuple[slice, ...]]:
    """``region`` cut along its first dimension at chunk boundaries, each slab under ``SLAB_BYTES`` if it can be."""
    step = chunk * max(1, SLAB_BYTES // max(row_bytes * chunk, 1))
    first = region[0]
    cuts = list(range(first.start - first.start % chunk + step, first.stop, step))
    edges = [first.start, *cuts, first.stop]
    return [(slice(a, b), *region[1:]) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def compute(layout: Layout, names: list[str]) -> Stats:
    """Mean and std of each variable in ``names`` over the training region, a slab at a time."""
    from nodescale.data.gridded import handle, open_store, read

    region = training_region(layout)
    store = open_store(layout.path, layout.kind)
    found: Stats = {}
    try:
        for var in (*layout.inputs, *layout.targets):
            if var.name not in names or var.name in found:
                continue
            row = 4 * int(np.prod([r.stop - r.start for r in region[1:]], dtype=np.int64))
            count, mean, m2 = 0, 0.0, 0.0
            array = handle(store, layout.kind, var.name)
            for slab in _slabs(region, var.chunks[0], row):
                values = read(array, layout.kind, slab).astype(np.float64)
                values = values[~np.isnan(values)]
                if not values.size:
                    continue
                n, slab_mean = values.size, float(values.mean())
                slab_m2 = float(((values - slab_mean) ** 2).sum())
                delta, total = slab_mean - mean, count + n
                mean += delta * n / total
                m2 += slab_m2 + delta * delta * count * n / total
                count = total
            std = (m2 / count) ** 0.5 if count else 0.0
            if not count or std == 0.0:
                raise UserError(f"variable {var.name!r} of {layout.path}", "is constant (or all NaN) over the "
                                "training split: it cannot be standardised", f"give its figures with "
                                f"--set data.stats={var.name}:MEAN:STD, or --set data.normalise=none")
            found[var.name] = (mean, std)
    finally:
        if layout.kind == "netcdf":
            store.close()
    return found


def _cache_path(layout: Layout, names: list[str]) -> str:
    stamp = os.stat(layout.path).st_mtime_ns
    key = json.dumps([str(layout.path.resolve()), layout.kind, stamp, sorted(names),
                      [(s.start, s.stop) for s in training_region(layout)]])
    return str(cache_dir() / "zarr-stats" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json")


def variable_stats(layout: Layout, given: Stats, write_cache: bool) -> Stats:
    """The figures of every input and target variable: ``given`` ones, the others from the cache or computed."""
    wanted = sorted({v.name for v in (*layout.inputs, *layout.targets)} - set(given))
    found: Stats = {}
    if wanted:
        path = _cache_path(layout, wanted)
        try:
            with open(path, encoding="utf-8") as file:
                found = {k: (float(m), float(s)) for k, (m, s) in json.load(file).items()}
        except (OSError, ValueError, TypeError):
            found = compute(layout, wanted)
            if write_cache:
                try:
                    write_json_atomic(cache_dir() / "zarr-stats" / os.path.basename(path), found)
                except OSError as err:  # a read-only home: every rank computes them instead
                    log.warning("could not cache the variables' statistics in %s (%s)", cache_dir(), err)
    return {**found, **given}
