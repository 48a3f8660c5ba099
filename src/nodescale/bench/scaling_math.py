"""The arithmetic of a scaling benchmark: speedup, efficiency, batch split and MFU.

Pure functions on numbers, no torch and no files, so every formula is unit
tested with hand-computed values.

One set of formulas serves strong and weak scaling because both are computed
on throughput (samples/s, all processes together), relative to the smallest
world size measured, ``b`` (the base):

- ``speedup(N) = throughput(N) / throughput(b)``
- ``ideal(N) = N / b``
- ``efficiency(N) = speedup(N) / ideal(N)``

Strong scaling keeps the global batch ``G``: throughput is ``G / step_time``,
so speedup is the classic time ratio ``step_time(b) / step_time(N)``. Weak
scaling keeps the per-process batch ``B``: throughput is ``N * B / step_time``,
so speedup is the "scaled speedup" and efficiency reduces to the classic weak
efficiency ``step_time(b) / step_time(N)`` (the step should not get slower as
processes are added).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import lcm
from typing import Literal

from nodescale.errors import UserError

Mode = Literal["strong", "weak"]
MODES: tuple[Mode, ...] = ("strong", "weak")


@dataclass(frozen=True)
class Measurement:
    """What one world size measured (from its run's ``summary.json``)."""

    world_size: int
    samples_per_second: float | None  # all processes together, warm-up excluded
    step_seconds: float | None  # slowest rank's timed seconds / timed steps


@dataclass(frozen=True)
class ScalingRow:
    """One world size relative to the base (the smallest world size measured)."""

    world_size: int
    samples_per_second: float | None
    step_seconds: float | None
    speedup: float | None  # throughput(N) / throughput(base)
    ideal_speedup: float  # N / base
    efficiency: float | None  # speedup / ideal_speedup, 1.0 = perfect


def parse_world_sizes(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``: whole numbers >= 1, no repeats, returned in increasing order."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise UserError(f"--world-sizes {text!r}", "must be a comma-separated list of whole numbers >= 1",
                        "e.g. --world-sizes 1,2,4")
    sizes = [int(part) for part in parts]
    if len(set(sizes)) != len(sizes):
        raise UserError(f"--world-sizes {text!r}", "lists a world size twice", "give each world size once")
    return sorted(sizes)


def per_process_batch(batch_size: int, world_size: int, mode: Mode) -> int:
    """The ``--batch-size`` each process trains with at ``world_size``.

    Strong scaling: ``batch_size`` is the global batch, split evenly (it must
    divide, or the runs would not do the same work per step). Weak scaling:
    ``batch_size`` is each process's batch, whatever the world size.
    """
    if mode == "weak":
        return batch_size
    check_batch_divides(batch_size, [world_size])
    return batch_size // world_size


def check_batch_divides(batch_size: int, world_sizes: Sequence[int]) -> None:
    """Strong scaling: refuse a global batch that some world size does not divide, suggesting one that all do."""
    bad = [n for n in world_sizes if batch_size % n]
    if bad:
        raise UserError(
            f"strong scaling with global batch {batch_size} at world size {', '.join(map(str, bad))}",
            "the global batch must divide evenly over the processes",
            f"use a --batch-size that every world size divides, e.g. {divisible_batch(batch_size, world_sizes)}",
        )


def divisible_batch(batch_size: int, world_sizes: Sequence[int]) -> int:
    """The smallest multiple of every world size that is at least ``batch_size``."""
    step = lcm(*world_sizes)
    return max(step, -(-batch_size // step) * step)


def scaling_rows(measurements: Sequence[Measurement]) -> list[ScalingRow]:
    """Speedup and efficiency of each world size relative to the smallest one.

    A world size without a throughput (nothing was timed) gets ``None`` for
    speedup and efficiency; if the base has none, every row does.
    """
    if not measurements:
        return []
    ordered = sorted(measurements, key=lambda m: m.world_size)
    base = ordered[0]
    rows = []
    for m in ordered:
        ideal = m.world_size / base.world_size
        speedup = None
        if m.samples_per_second is not None and base.samples_per_second:
            speedup = m.samples_per_second / base.samples_per_second
        efficiency = None if speedup is None else speedup / ideal
        rows.append(ScalingRow(m.world_size, m.samples_per_second, m.step_seconds, speedup, ideal, efficiency))
    return rows


def achieved_flops(samples_per_second: float | None, training_flops_per_sample: float | None) -> float | None:
    """FLOP/s the whole job did: training FLOPs per sample x samples/s (``None`` if either is unknown)."""
    if samples_per_second is None or training_flops_per_sample is None:
        return None
    return samples_per_second * training_flops_per_sample


def mfu(
    samples_per_second: float | None,
    training_flops_per_sample: float | None,
    peak_flops_per_device: float | None,
    devices: int,
) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s / (peak FLOP/s per device x devices), 0..1.

    ``None`` (unknown) whenever a factor is unknown: an MFU is never guessed.
    """
    achieved = achieved_flops(samples_per_second, training_flops_per_sample)
    if achieved is None or not peak_flops_per_device or devices < 1:
        return None
    return achieved / (peak_flops_per_device * devices)


def infer_mode(batches: Sequence[tuple[int, int]]) -> Mode | None:
    """Which mode runs of ``(batch_size_per_process, global_batch_size)`` are consistent with.

    Strong if every run has the same global batch, weak if every run has the
    same per-process batch, ``None`` if neither. A single run fits both;
    strong is returned then (the arithmetic is the same for one point).
    """
    if len({global_batch for _, global_batch in batches}) <= 1:
        return "strong"
    if len({per_process for per_process, _ in batches}) <= 1:
        return "weak"
    return None


def fits_mode(mode: Mode, batches: Sequence[tuple[int, int]]) -> bool:
    """Whether runs of ``(batch_size_per_process, global_batch_size)`` keep what ``mode`` keeps fixed."""
    index = 1 if mode == "strong" else 0
    return len({batch[index] for batch in batches}) <= 1
