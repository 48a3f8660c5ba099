"""Bandwidth arithmetic and the rows for the timed all_reduce and the link test.

Definitions from nccl-tests (``doc/PERFORMANCE.md``): for an all_reduce of S bytes taking t
seconds, the algorithm bandwidth is ``algbw = S / t`` and the bus bandwidth, what the busiest
link carried and comparable with the hardware's peak, is ``busbw = algbw * 2 (n - 1) / n``.
GB/s means 1e9 bytes per second. Pure functions; the measuring is :mod:`.collective`'s.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from nodescale.bench import comm_math
from nodescale.bench.comm_math import algbw_gbps
from nodescale.distributed.rank_labels import ranks_label
from nodescale.doctor.check import Check, fail, ok, warn

SLOW_FRACTION = 0.5  # a rank below half the median is "far below the rest of the job"


def busbw_gbps(size_bytes: int, seconds: float, world_size: int) -> float:
    """all_reduce bus bandwidth in GB/s: ``algbw * 2 (n - 1) / n`` (0 for a single rank), as bench comm's."""
    return comm_math.busbw_gbps("all_reduce", size_bytes, seconds, world_size) if world_size > 0 else 0.0


def slow_outliers(values: Mapping[int, float], fraction: float = SLOW_FRACTION) -> dict[int, float]:
    """The entries below ``fraction`` times the median of all of them.

    With one value there is nothing to compare with; with two, the median is their mean, so
    one of them is flagged only when it is below a third of the other (at 0.5).
    """
    if len(values) < 2:
        return {}
    median = statistics.median(values.values())
    return {key: value for key, value in values.items() if value < fraction * median}


def check_allreduce(results: Mapping[int, Mapping[str, Any]], world_size: int,
                    hosts: Mapping[int, str]) -> list[Check]:
    """Rows for the verified, timed all_reduce from every rank's measurement.

    Each result has ``error`` (or None), ``verified``, ``wrong``, ``expected``, ``got``, ``bytes``,
    ``iters``, ``seconds`` (one operation, this rank's clock) and ``passes``.
    """
    errors = {rank: r["error"] for rank, r in results.items() if r.get("error")}
    if errors:
        first = min(errors)
        who = ranks_label(errors)
        return [fail("allreduce.result", f"{who}: {errors[first]}",
                     "the process group did not work: see the network rows above, then run with "
                     "NCCL_DEBUG=INFO (or TORCH_DISTRIBUTED_DEBUG=DETAIL for gloo) for the failing ranks")]
    wrong = {rank: r for rank, r in results.items() if not r.get("verified")}
    if wrong:
        rank = min(wrong)
        r = wrong[rank]
        return [fail("allreduce.result", f"rank {rank}: {r['wrong']} of {r['elements']} elements wrong (got "
                     f"{r['got']}, expected {r['expected']:g})" + (f"; also {ranks_label(wrong)}"
                                                                    if len(wrong) > 1 else ""),
                     "wrong sums without an error point at the device or driver (GPU memory errors, a bad "
                     "PCIe/NVLink path): check nvidia-smi -q for ECC errors on that host")]
    some = results[min(results)]
    rows = [ok("allreduce.result", f"sum of rank+1 over {world_size} ranks = {some['expected']:g} in every "
               f"element on every rank ({some['passes']} checks, {some['dtype']})")]
    if world_size == 1:
        return [*rows, ok("allreduce.bandwidth", "one rank: nothing crosses a link, so nothing to time")]
    seconds = {rank: float(r["seconds"]) for rank, r in results.items()}
    size = int(some["bytes"])
    slowest = max(seconds.values())
    rows.append(ok("allreduce.bandwidth", f"{_size(size)} x {some['iters']} on {some['backend']}: "
                   f"{slowest * 1e3:.2f} ms per all_reduce (slowest rank), algbw {algbw_gbps(size, slowest):.2f} "
                   f"GB/s, busbw {busbw_gbps(size, slowest, world_size):.2f} GB/s"))
    per_rank = {rank: busbw_gbps(size, s, world_size) for rank, s in seconds.items()}
    rows.append(_outlier_row("allreduce.slow_ranks", per_rank, "rank", hosts, "all_reduce busbw of each rank"))
    return rows


def check_links(links: Mapping[int, float], size_bytes: int, hosts: Mapping[int, str], kind: str) -> Check:
    """The link test: rank 0's round trips with one rank per node (``kind`` "node"), or with
    every rank when all are on one node (``kind`` "rank"). ``links`` maps rank -> seconds per
    round trip of ``size_bytes`` each way."""
    if not links:
        return ok("links.slow_nodes", "one rank: no link to measure")
    gbps = {rank: algbw_gbps(2 * size_bytes, seconds) for rank, seconds in links.items()}
    return _outlier_row("links.slow_nodes", gbps, kind, hosts, f"round trips rank 0 <-> each {kind}, both ways")


def _outlier_row(name: str, gbps: Mapping[int, float], kind: str, hosts: Mapping[int, str], what: str) -> Check:
    slow = slow_outliers(gbps)
    median = statistics.median(gbps.values())
    if slow:
        listed = ", ".join(f"rank {rank}{_host(hosts, rank)} {value:.2f}" for rank, value in sorted(slow.items()))
        return warn(name, f"{what} (GB/s): {listed}, below {SLOW_FRACTION:g}x the median {median:.2f}",
                    "a slow node or link: check that host's network (ibstat, link speed, errors), its "
                    "NCCL_SOCKET_IFNAME/NCCL_IB_HCA, and what else runs there")
    if len(gbps) <= 8:
        shown = ", ".join(f"rank {rank} {value:.2f}" for rank, value in sorted(gbps.items()))
        return ok(name, f"{what} (GB/s): {shown}; none below {SLOW_FRACTION:g}x the median")
    return ok(name, f"{what}: {len(gbps)} {kind}s from {min(gbps.values()):.2f} to {max(gbps.values()):.2f} GB/s, "
              f"none below {SLOW_FRACTION:g}x the median {median:.2f}")


def _host(hosts: Mapping[int, str], rank: int) -> str:
    return f" ({hosts[rank]})" if rank in hosts else ""


def _size(size_bytes: int) -> str:
    return f"{size_bytes / 2**20:g} MiB" if size_bytes >= 2**20 else f"{size_bytes / 2**10:g} KiB"


def partners(node_ranks: Sequence[int], limit: int = 64) -> tuple[str, list[int]]:
    """Which ranks rank 0 measures a link with: the first rank of every other node, or every
    other rank when all are on one node (at most ``limit``, to bound the time others wait)."""
    if len(set(node_ranks)) > 1:
        first: dict[int, int] = {}
        for rank, node in enumerate(node_ranks):
            first.setdefault(node, rank)
        return "node", [rank for node, rank in sorted(first.items()) if node != node_ranks[0]][:limit]
    return "rank", list(range(1, len(node_ranks)))[:limit]
