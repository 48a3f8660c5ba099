"""The arithmetic of ``bench comm``, exactly as nccl-tests does it: sizes, element counts, bandwidths.

No torch here: sizes parsing, how many elements each collective moves for a requested size, and
the two bandwidths of NVIDIA/nccl-tests (``doc/PERFORMANCE.md`` and each ``src/<op>.cu``):

* ``algbw = S / t``, S the operation's size in bytes, t the time of one operation.
* ``busbw = algbw * factor``, the factor turning algbw into the traffic on the busiest link,
  so that the number is comparable with the hardware's link bandwidth whatever the rank count:
  all_reduce ``2(n-1)/n``; all_gather, reduce_scatter, all_to_all ``(n-1)/n``; broadcast,
  reduce, send/recv ``1``.

S is what nccl-tests prints in its ``size`` column: ``max(send bytes, receive bytes)``. For
all_gather it is the gathered output (n x the per-rank input), for reduce_scatter the input
(n x the per-rank output), for all_to_all the whole send buffer. nccl-tests splits such sizes
per rank and rounds the per-rank count down to whole 16-byte lines
(``(count/nranks) & -(16/eltSize)`` in ``GetCollByteCount``); :func:`op_counts` does the same
and reports the bytes really moved. GB/s here is 1e9 bytes per second, as in nccl-tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nodescale.errors import UserError, unknown_choice

# nccl-tests' binaries, named as torch.distributed names the calls; "sendrecv" is sendrecv_perf.
OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "sendrecv")
REDUCTIONS = frozenset({"all_reduce", "reduce_scatter"})
# nccl-tests does not check in-place all_to_all or sendrecv (reportErrors = 0, printed N/A): a
# buffer that is both sent and overwritten has no defined result. They are measured out of place only.
IN_PLACE_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast"})
# Ops whose size is split into n per-rank pieces, rounded down to 16-byte lines by nccl-tests.
PER_RANK_OPS = frozenset({"all_gather", "reduce_scatter", "all_to_all"})

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int32": 4}
# The largest integer M such that every integer 0..M is exact in the type: sums of integer
# fills stay exact, in any reduction order, while they stay below it.
EXACT_INTEGER_LIMIT: dict[str, int] = {
    "float32": 2**24, "bfloat16": 2**8, "float16": 2**11, "float64": 2**53, "int32": 2**31 - 1,
}
ALIGN_BYTES = 16
GB = 1e9  # GB/s = 1e9 bytes per second, as nccl-tests prints

_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
_SIZE = re.compile(r"(\d+)\s*([KMG]?)(?:I?B)?", re.IGNORECASE)
_SIZES_HINT = "give SIZE or START:END (doubling), sizes in bytes with K, M, G = powers of 1024, e.g. 1K:256M or 64M"


def parse_size(text: str) -> int:
    """Bytes from ``8``, ``1K``, ``256M``, ``1G`` (K, M, G = 1024, 1024**2, 1024**3, as nccl-tests' ``-b``/``-e``).

    >>> parse_size("256M")
    268435456
    """
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise UserError(f"size {text!r}", "is not a number of bytes with an optional K, M or G", _SIZES_HINT)
    size = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if size <= 0:
        raise UserError(f"size {text!r}", "must be at least 1 byte", _SIZES_HINT)
    return size


def parse_sizes(spec: str) -> list[int]:
    """The message sizes of ``--sizes``: ``SIZE``, or ``START:END`` doubling from START while <= END.

    Like ``nccl-tests -b START -e END -f 2``: END is included only when a doubling reaches it.

    >>> parse_sizes("1K:8K")
    [1024, 2048, 4096, 8192]
    """
    parts = spec.split(":")
    if len(parts) > 2:
        raise UserError(f"--sizes {spec!r}", "has more than one ':'", _SIZES_HINT)
    try:
        bounds = [parse_size(part) for part in parts]
    except UserError as exc:  # name the flag, not just the piece that was wrong
        raise UserError(f"--sizes {spec!r}", f"{exc.what} {exc.rule}", _SIZES_HINT) from None
    if len(bounds) == 1:
        return bounds
    start, end = bounds
    if end < start:
        raise UserError(f"--sizes {spec!r}", f"ends ({end} B) below where it starts ({start} B)", _SIZES_HINT)
    sizes = []
    size = start
    while size <= end:
        sizes.append(size)
        size *= 2
    return sizes


def parse_ops(spec: str) -> list[str]:
    """The operations of ``--ops``: comma-separated names from :data:`OPS`, or ``all``, in the order of OPS."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise UserError(f"--ops {spec!r}", "names no operation", f"choose from: {', '.join(OPS)}")
    if names == ["all"]:
        return list(OPS)
    for name in names:
        if name not in OPS:
            raise unknown_choice("operation", name, OPS)
    return [op for op in OPS if op in names]


def check_dtype(name: str) -> str:
    """``name`` if it is a data type ``bench comm`` knows, else a :class:`UserError`."""
    if name not in DTYPE_BYTES:
        raise unknown_choice("dtype", name, DTYPE_BYTES)
    return name


@dataclass(frozen=True)
class Counts:
    """What one operation moves for a requested size, in elements and bytes (nccl-tests' GetCollByteCount).

    ``count`` is the count argument of the call (nccl-tests' ``count`` column): per rank for
    all_gather (each rank's input), reduce_scatter (each rank's output) and all_to_all (each peer's
    block); the whole buffer otherwise. ``send``/``recv`` are the buffers' element counts.
    """

    op: str
    requested_bytes: int
    element_bytes: int
    world_size: int
    count: int
    send: int
    recv: int

    @property
    def bytes(self) -> int:
        """The size S of the operation: nccl-tests' ``max(sendBytes, expectedBytes)``."""
        return max(self.send, self.recv) * self.element_bytes


def op_counts(op: str, size_bytes: int, element_bytes: int, world_size: int) -> Counts:
    """Element counts of ``op`` for a requested size of ``size_bytes``, rounded down as nccl-tests does.

    >>> op_counts("all_gather", 1024, 4, 3).bytes  # 256 floats -> 85 per rank -> 84 (16-byte lines) x 3
    1008
    """
    if op not in OPS:
        raise unknown_choice("operation", op, OPS)
    if world_size < 1 or element_bytes < 1:
        raise ValueError(f"world_size {world_size} and element_bytes {element_bytes} must be positive")
    count = size_bytes // element_bytes
    if op in PER_RANK_OPS:
        # (count/nranks) & -(16/eltSize): per-rank pieces of whole 16-byte lines.
        per_line = max(1, ALIGN_BYTES // element_bytes)
        per_rank = (count // world_size) // per_line * per_line
        total = per_rank * world_size
        send, recv = {
            "all_gather": (per_rank, total),
            "reduce_scatter": (total, per_rank),
            "all_to_all": (total, total),
        }[op]
        return Counts(op, size_bytes, element_bytes, world_size, per_rank, send, recv)
    return Counts(op, size_bytes, element_bytes, world_size, count, count, count)


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw factor for ``op`` on ``world_size`` ranks (``doc/PERFORMANCE.md``, Summary)."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise unknown_choice("operation", op, OPS)


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth S/t in GB/s (1e9 bytes/s); 0 for a zero time (nothing measured)."""
    return size_bytes / seconds / GB if seconds > 0 else 0.0


def busbw_gbps(op: str, size_bytes: int, seconds: float, world_size: int) -> float:
    """Bus bandwidth in GB/s: :func:`algbw_gbps` times :func:`bus_factor`."""
    return algbw_gbps(size_bytes, seconds) * bus_factor(op, world_size)


def fill_modulus(dtype: str, world_size: int) -> tuple[int, bool]:
    """The modulus K of the check's fill values ``(index + rank) % K``, and whether sums are exact.

    Values 0..K-1 summed over n ranks reach at most n(K-1); while that is within
    :data:`EXACT_INTEGER_LIMIT` every partial sum is an exact integer whatever the order of the
    reduction, so the result can be compared for equality. K is at most 16 and at least 2; where
    even K = 2 overflows the exact range (bfloat16 beyond 256 ranks) the check needs a tolerance.
    """
    limit = EXACT_INTEGER_LIMIT[dtype]
    modulus = max(2, min(16, limit // max(1, world_size) + 1))
    return modulus, world_size * (modulus - 1) <= limit


@dataclass(frozen=True)
class Settings:
    """What one ``bench comm`` run measures: checked by the CLI before any process starts, hence no torch."""

    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    dtype: str
    warmup: int
    iters: int
