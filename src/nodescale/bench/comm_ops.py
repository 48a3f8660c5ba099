"""The collectives of ``bench comm``: buffers, one call, and the exact result each rank must hold.

Each :class:`Case` is one operation at one size, in place or out of place, on one process group.
Inputs are filled with ``(index + rank) % K`` (:func:`fill`): small integers, exact in every data
type, different on every rank and at every position, so a lost, swapped, shifted or doubled
contribution changes the result. Outputs start at -1, a value no correct result contains, so a
buffer the operation never wrote is caught as well.

In place and out of place follow nccl-tests: in place, the input is the rank's own slice of the
output buffer (all_gather) or the output is the rank's slice of the input (reduce_scatter), the
layouts NCCL requires. torch's all_reduce and broadcast exist only in place; their out-of-place
variant copies the input into the output buffer and runs the in-place call on it, so its time
includes one device-local copy of S bytes (on the root only, for broadcast).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nodescale.bench.comm_math import Counts

ROOT = 0  # broadcast root (a group rank), nccl-tests' default -r 0

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float64": torch.float64, "int32": torch.int32,
}

# torch 2.13 renamed the tensor forms and deprecates the old names; the project supports torch >= 2.6.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Group:
    """The ranks an operation runs on: the whole job, or two ranks of ``--pairs``."""

    group: dist.ProcessGroup | None  # None: the default (world) group
    rank: int  # this process's rank in the group
    global_ranks: tuple[int, ...]  # group rank -> global rank, for point-to-point peers
    device: torch.device
    dtype: torch.dtype
    modulus: int  # K of the fills
    exact: bool  # whether reduced values are exact integers (else compared with a tolerance)

    @property
    def size(self) -> int:
        return len(self.global_ranks)


def fill(group: Group, rank: int, start: int, length: int) -> torch.Tensor:
    """The input a rank ``rank`` contributes at positions ``start..start+length``: ``(index + rank) % K``."""
    return _pattern(group, start, length, rank).to(group.dtype)


def summed(group: Group, start: int, length: int) -> torch.Tensor:
    """The sum over all ranks of :func:`fill` at positions ``start..start+length``, in int64.

    ``sum_r (i + r) % K`` has K distinct terms: term t appears ``n // K`` times, plus once more
    for t < n % K, so the loop runs min(n, K) times however many ranks there are.
    """
    n, k = group.size, group.modulus
    total = torch.zeros(length, dtype=torch.int64, device=group.device)
    for t in range(min(n, k)):
        total += (n // k + (1 if t < n % k else 0)) * _pattern(group, start, length, t)
    return total


def _pattern(group: Group, start: int, length: int, offset: int) -> torch.Tensor:
    index = torch.arange(start, start + length, dtype=torch.int64, device=group.device)
    return (index + offset) % group.modulus


def count_wrong(actual: torch.Tensor, expected: torch.Tensor, group: Group) -> int:
    """How many elements of ``actual`` differ from ``expected`` (int64); a tolerance only where sums are inexact."""
    if group.exact or not actual.is_floating_point():
        return int((actual != expected.to(actual.dtype)).sum().item())
    # Beyond the exact range (bfloat16 on > 256 ranks) the order of the additions rounds
    # differently; allow n roundings of the result.
    eps = torch.finfo(actual.dtype).eps
    want = expected.to(torch.float64)
    return int(((actual.to(torch.float64) - want).abs() > group.size * eps * want.abs()).sum().item())


class Case:
    """One operation at one size on one group.

    :meth:`run` is what is timed; :meth:`reset`, one :meth:`run` and :meth:`wrong` are the check.
    """

    def __init__(self, op: str, counts: Counts, in_place: bool, group: Group) -> None:
        self.op, self.counts, self.in_place, self.g = op, counts, in_place, group
        self._expected: Callable[[], torch.Tensor]
        self.run: Callable[[], None]
        self.reset: Callable[[], None]
        self.output: torch.Tensor
        getattr(self, f"_{op}")()
        self.reset()  # timed iterations run on the same data as the check

    def wrong(self) -> int:
        """Wrong elements of this rank's result (call after :meth:`reset` and one :meth:`run`)."""
        return count_wrong(self.output, self._expected(), self.g)

    # One method per operation: allocate, then define run, reset, output and the expected result.

    def _empty(self, length: int) -> torch.Tensor:
        return torch.empty(length, dtype=self.g.dtype, device=self.g.device)

    def _all_reduce(self) -> None:
        g, c = self.g, self.counts.count
        self.output = self._empty(c)
        source = self.output if self.in_place else self._empty(c)

        def reset() -> None:
            source.copy_(fill(g, g.rank, 0, c))
            if not self.in_place:
                self.output.fill_(-1)

        def run() -> None:
            if not self.in_place:
                self.output.copy_(source)
            dist.all_reduce(self.output, group=g.group)

        self.reset, self.run = reset, run
        self._expected = lambda: summed(g, 0, c)

    def _broadcast(self) -> None:
        g, c = self.g, self.counts.count
        self.output = self._empty(c)
        source = self.output if self.in_place else self._empty(c)
        root = g.global_ranks[ROOT]

        def reset() -> None:
            self.output.fill_(-1)
            if g.rank == ROOT or not self.in_place:
                source.copy_(fill(g, g.rank, 0, c))

        def run() -> None:
            if not self.in_place and g.rank == ROOT:
                self.output.copy_(source)
            dist.broadcast(self.output, src=root, group=g.group)

        self.reset, self.run = reset, run
        self._expected = lambda: fill(g, ROOT, 0, c)

    def _all_gather(self) -> None:
        g, c, n = self.g, self.counts.count, self.g.size
        self.output = self._empty(c * n)
        mine = self.output[g.rank * c:(g.rank + 1) * c] if self.in_place else self._empty(c)

        def reset() -> None:
            self.output.fill_(-1)
            mine.copy_(fill(g, g.rank, 0, c))

        self.reset = reset
        self.run = lambda: _all_gather(self.output, mine, group=g.group)
        self._expected = lambda: torch.cat([fill(g, r, 0, c) for r in range(n)])

    def _reduce_scatter(self) -> None:
        g, c, n = self.g, self.counts.count, self.g.size
        source = self._empty(c * n)
        self.output = source[g.rank * c:(g.rank + 1) * c] if self.in_place else self._empty(c)

        def reset() -> None:
            if not self.in_place:
                self.output.fill_(-1)
            source.copy_(fill(g, g.rank, 0, c * n))

        self.reset = reset
        self.run = lambda: _reduce_scatter(self.output, source, group=g.group)
        self._expected = lambda: summed(g, g.rank * c, c)

    def _all_to_all(self) -> None:
        g, c, n = self.g, self.counts.count, self.g.size
        source, self.output = self._empty(c * n), self._empty(c * n)

        def reset() -> None:
            self.output.fill_(-1)
            source.copy_(fill(g, g.rank, 0, c * n))

        self.reset = reset
        self.run = lambda: dist.all_to_all_single(self.output, source, group=g.group)
        # Block s of my output is block `rank` of rank s's input.
        self._expected = lambda: torch.cat([fill(g, s, g.rank * c, c) for s in range(n)])

    def _sendrecv(self) -> None:
        # nccl-tests' sendrecv: every rank sends to rank+1 and receives from rank-1, as one group call.
        g, c, n = self.g, self.counts.count, self.g.size
        source, self.output = self._empty(c), self._empty(c)
        send_to, receive_from = g.global_ranks[(g.rank + 1) % n], g.global_ranks[(g.rank - 1) % n]

        def reset() -> None:
            self.output.fill_(-1)
            source.copy_(fill(g, g.rank, 0, c))

        def run() -> None:
            ops = [dist.P2POp(dist.isend, source, send_to, group=g.group),
                   dist.P2POp(dist.irecv, self.output, receive_from, group=g.group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        self.reset, self.run = reset, run
        self._expected = lambda: fill(g, (g.rank - 1) % n, 0, c)
