"""All of rank 0's checks, in table order, and the decision whether the collective may run.

Pure: the ranks' facts and what the exchange saw go in; rows and a :class:`Plan` come out.
Checks that look at one rank's own facts (its interfaces, its variables) run per rank and
identical rows are merged, so a healthy 512-rank job shows one row per check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from nodescale.doctor import bandwidth, consistency, launch_math, names, network, numa
from nodescale.doctor.check import FAIL, Check, fail, merge_rank_rows
from nodescale.doctor.facts import RankFacts

# Table order: what to fix first comes first.
_AREAS = ("launch", "network", "env", "versions", "devices", "facts", "cpu", "allreduce", "links")


@dataclass
class Plan:
    """Rank 0's decision, announced to every rank: run the collective or not, and how."""

    run: bool
    backend: str
    reason: str = ""
    partners: list[int] = field(default_factory=list)
    link_kind: str = "rank"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data."""
        return asdict(self)


def choose_backend(requested: str, rank0: RankFacts) -> str:
    """The backend every rank uses: the requested one, else rank 0's choice (nccl on CUDA)."""
    return requested if requested != "auto" else rank0.backend


def before_collective(facts: Mapping[int, RankFacts], world_size: int, missing: Sequence[int],
                      claims: Mapping[int, int], timeout_s: float, store_check: Check, mode: str,
                      backend: str) -> list[Check]:
    """Every check that needs only the facts (rank 0's must be among them)."""
    rank0 = facts[0]
    master = f"{rank0.master_addr}:{rank0.master_port}"
    rows = [launch_math.check_reported(world_size, missing, timeout_s, master),
            launch_math.check_claims(facts, world_size, claims)]
    rows += launch_math.check_layout(facts, world_size)
    rows.append(launch_math.check_allocation(launch_math.allocation(rank0), rank0))
    rows += launch_math.check_gpus_per_node(facts, backend)
    rows.append(store_check)
    several_hosts = len({f.host for f in facts.values()}) > 1
    rows += merge_rank_rows({rank: [network.check_master_resolves(f),
                                    network.check_gloo_interfaces(f, backend, several_hosts),
                                    network.check_nccl_interfaces(f, backend)] for rank, f in facts.items()},
                            world_size)
    rows.append(network.check_master_placement(rank0, facts, missing, mode))
    rows += merge_rank_rows({rank: names.check_variables(f.comm_env) for rank, f in facts.items()}, world_size)
    rows += consistency.check_versions(facts)
    rows += consistency.check_devices(facts, backend)
    rows.append(consistency.check_affinity(facts))
    rows.append(numa.check_locality(facts))
    return ordered(rows)


def ordered(rows: Sequence[Check]) -> list[Check]:
    """Rows by area (launch, network, env, ...), keeping their order within an area."""
    def area(row: Check) -> int:
        head = row.name.split(".")[0]
        return _AREAS.index(head) if head in _AREAS else len(_AREAS)

    return sorted(rows, key=area)


def plan(rows: Sequence[Check], facts: Mapping[int, RankFacts], backend: str) -> Plan:
    """Run the collective unless a blocking row failed; the link partners if it runs."""
    blocking = [row for row in rows if row.blocking and row.status == FAIL]
    if blocking:
        return Plan(False, backend, "; ".join(f"{row.name}" for row in blocking))
    node_ranks = [facts[rank].node_rank for rank in sorted(facts)]
    kind, partners = bandwidth.partners(node_ranks)
    return Plan(True, backend, "", partners, kind)


def after_collective(plan_: Plan, results: Mapping[int, Mapping[str, Any]], missing: Sequence[int],
                     facts: Mapping[int, RankFacts], world_size: int, timeout_s: float) -> list[Check]:
    """Rows for the collective: not run (and why), ranks that did not answer, or its measurements."""
    if not plan_.run:
        return [fail("allreduce.result", f"not run: a process group would not start ({plan_.reason} failed above)",
                     "fix the failing rows above; the all_reduce runs once nothing blocks it")]
    hosts = {rank: f.host for rank, f in facts.items()}
    if missing:
        return [fail("allreduce.result", f"ranks {', '.join(map(str, missing))} sent no result within "
                     f"{2 * timeout_s:g} s", "those ranks hung or died in the process group: see their error "
                     "output, then run with NCCL_DEBUG=INFO")]
    rows = bandwidth.check_allreduce(results, world_size, hosts)
    if not any(row.status == FAIL for row in rows):
        links = {int(rank): seconds for rank, seconds in (results[0].get("links") or {}).items()}
        rows.append(bandwidth.check_links(links, int(results[0]["bytes"]), hosts, plan_.link_kind))
    return rows
