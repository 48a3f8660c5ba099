"""The hosts the doctor's measurements point at, for the bad-node file (:mod:`nodescale.bad_nodes`).

Only what singles out some hosts of several: wrong all_reduce sums on some ranks (a device or
driver fault), a rank's busbw or rank 0's link with a node below half the median (the rows
``allreduce.slow_ranks`` and ``links.slow_nodes``). A failure on every host is the setup's, not
a node's, and leaving every node out would leave no job. Pure: measurements in, hosts out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nodescale.bench.comm_math import algbw_gbps
from nodescale.doctor.bandwidth import SLOW_FRACTION, busbw_gbps, slow_outliers


def flagged_hosts(results: Mapping[int, Mapping[str, Any]], hosts: Mapping[int, str],
                  world_size: int) -> dict[str, str]:
    """host -> reason, for hosts that some of the measurements single out (empty on one host)."""
    if len(set(hosts.values())) < 2 or not results:
        return {}
    found: dict[str, str] = {}

    def add(ranks: Mapping[int, str]) -> None:
        named = {hosts[rank]: why for rank, why in sorted(ranks.items()) if rank in hosts}
        if set(named) < set(hosts.values()):  # some hosts, not all
            for host, why in named.items():
                found.setdefault(host, why)

    add({rank: f"doctor: all_reduce gave {r.get('wrong')} wrong elements on rank {rank}"
         for rank, r in results.items() if not r.get("error") and not r.get("verified")})
    if any(r.get("error") or not r.get("seconds") for r in results.values()):
        return found
    size = int(results[min(results)]["bytes"])
    busbw = {rank: busbw_gbps(size, float(r["seconds"]), world_size) for rank, r in results.items()}
    add({rank: f"doctor: all_reduce busbw {value:.2f} GB/s on rank {rank}, below {SLOW_FRACTION:g}x the median"
         for rank, value in slow_outliers(busbw).items()})
    links = {int(rank): algbw_gbps(2 * size, seconds)
             for rank, seconds in (results.get(0, {}).get("links") or {}).items() if seconds}
    add({rank: f"doctor: link rank 0 <-> rank {rank} {value:.2f} GB/s, below {SLOW_FRACTION:g}x the median"
         for rank, value in slow_outliers(links).items()})
    return found
