"""The device peak table (``peaks.yaml``): peak dense FLOP/s per device and dtype.

Lookups are exact on the name torch reports. A device that is not in the
table (every CPU, and any GPU nobody has entered) has no peak, so its MFU is
unknown: a peak is never guessed from a similar name.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import yaml

DTYPES = ("fp32", "tf32", "bf16", "fp16")
PEAK_DTYPE_CHOICES = ("auto", *DTYPES)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one object per table entry
class DevicePeak:
    """One entry of the table: the names of one device model, its peaks and their source."""

    names: tuple[str, ...]
    tflops: dict[str, float]  # dtype -> peak dense TFLOP/s per device
    source: str

    def flops(self, dtype: str) -> float | None:
        """Peak FLOP/s per device for ``dtype``; ``None`` where the device has no such hardware."""
        value = self.tflops.get(dtype)
        return None if value is None else value * 1e12


def _entry(raw: Any, index: int) -> DevicePeak:
    # The table is nodescale's own data: a malformed entry is a bug, reported as such.
    if not isinstance(raw, dict):
        raise ValueError(f"peaks.yaml entry {index}: not a mapping")
    names, tflops, source = raw.get("names"), raw.get("tflops"), raw.get("source")
    if not names or not all(isinstance(name, str) and name.strip() for name in names):
        raise ValueError(f"peaks.yaml entry {index}: `names` must be a non-empty list of device names")
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"peaks.yaml entry {index} ({names[0]}): no `source`")
    if not isinstance(tflops, dict) or not tflops:
        raise ValueError(f"peaks.yaml entry {index} ({names[0]}): `tflops` must map dtypes to numbers")
    for dtype, value in tflops.items():
        if dtype not in DTYPES or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"peaks.yaml entry {index} ({names[0]}): bad peak {dtype}: {value!r}")
    return DevicePeak(tuple(names), {dtype: float(value) for dtype, value in tflops.items()}, source.strip())


def parse_peaks(text: str) -> dict[str, DevicePeak]:
    """The table in ``text`` (the YAML of ``peaks.yaml``), by device name."""
    raw = yaml.safe_load(text) or {}
    table: dict[str, DevicePeak] = {}
    for index, item in enumerate(raw.get("devices") or []):
        entry = _entry(item, index)
        for name in entry.names:
            if name in table:
                raise ValueError(f"peaks.yaml: device {name!r} listed twice")
            table[name] = entry
    return table


@cache
def load_peaks() -> dict[str, DevicePeak]:
    """The packaged peak table, by device name."""
    text = resources.files("nodescale.bench").joinpath("peaks.yaml").read_text(encoding="utf-8")
    return parse_peaks(text)


def find_peak(device_name: str | None, table: dict[str, DevicePeak] | None = None) -> DevicePeak | None:
    """The entry for ``device_name`` exactly as torch reports it, or ``None`` (unknown device, CPU)."""
    if not device_name:
        return None
    return (load_peaks() if table is None else table).get(device_name.strip())


def peak_dtype(precision: str, peak: DevicePeak | None, choice: str = "auto") -> str:
    """The dtype whose peak an MFU of a run in ``precision`` is measured against.

    ``auto``: bf16 and fp16 runs use their own peak. fp32 runs use the TF32
    peak where the device has one, because PyTorch lets cuDNN run fp32
    convolutions on TF32 tensor cores by default
    (``torch.backends.cudnn.allow_tf32``): against the plain fp32 peak a
    convolutional net could show more than 100%. This understates the MFU of
    fp32 models made only of matrix products (TF32 matmuls are off by
    default); pass ``fp32`` explicitly for those.
    """
    if choice != "auto":
        return choice
    if precision == "fp32":
        return "tf32" if peak is not None and "tf32" in peak.tflops else "fp32"
    return precision
