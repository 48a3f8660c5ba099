"""Network checks on one rank's facts: the interfaces its variables name, and where ranks meet.

Pure functions: facts in, rows out. A wrong interface name is the classic silent hang: gloo
stops at once ("Unable to find address for: eth1"), but NCCL with an
``NCCL_SOCKET_IFNAME`` that matches nothing, or gloo on a node whose host name resolves to
127.0.1.1, leaves every rank waiting for peers that connect to the wrong address.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nodescale.doctor.check import Check, fail, ok, warn
from nodescale.doctor.facts import RankFacts
from nodescale.doctor.host import is_loopback
from nodescale.launch.envcheck import interface_list


def _usable(info: Mapping[str, Any]) -> bool:
    """An interface a socket can be bound to: it has an address and is not down."""
    return bool(info.get("addresses")) and info.get("state") != "down"


def _inventory(interfaces: Mapping[str, Mapping[str, Any]]) -> str:
    parts = []
    for name, info in interfaces.items():
        addresses = info.get("addresses") or []
        parts.append(f"{name} ({addresses[0]})" if addresses else f"{name} (no address)")
    return ", ".join(parts) or "none found"


def check_gloo_interfaces(facts: RankFacts, backend: str, several_hosts: bool = False) -> Check:
    """``GLOO_SOCKET_IFNAME``: every name in it is an interface of this host with an address.

    Gloo reads a comma-separated list of exact interface names. Without the variable it uses
    the address the host name resolves to, which must not be loopback when the ranks run on
    ``several_hosts``. A failure is blocking when the doctor's collective would run on gloo.
    """
    name = "network.GLOO_SOCKET_IFNAME"
    value = facts.comm_env.get("GLOO_SOCKET_IFNAME")
    blocking = backend == "gloo"
    if value is None:
        if backend == "gloo" and several_hosts and facts.host_resolved and is_loopback(facts.host_resolved):
            return fail(name, f"not set, and host name {facts.host} resolves to {facts.host_resolved}: gloo would "
                        "offer that loopback address to the other hosts",
                        f"export GLOO_SOCKET_IFNAME=<interface>; {facts.host} has {_inventory(facts.interfaces)}",
                        blocking=True)
        return ok(name, "not set: gloo uses the address its host name resolves to")
    for item in value.split(","):
        info = facts.interfaces.get(item)
        if info is None:
            return fail(name, f"GLOO_SOCKET_IFNAME={value}: no interface {item!r} on host {facts.host}",
                        f"{facts.host} has {_inventory(facts.interfaces)}; use one of those that carries the "
                        "job's network, or unset the variable", blocking=blocking)
        if not _usable(info):
            why = "is down" if info.get("addresses") else "has no IP address"
            return fail(name, f"GLOO_SOCKET_IFNAME={value}: interface {item!r} on host {facts.host} {why}",
                        f"{facts.host} has {_inventory(facts.interfaces)}", blocking=blocking)
    # No host or address in an ok row: identical rows of all ranks collapse into one.
    return ok(name, f"GLOO_SOCKET_IFNAME={value}: present, with an address")


def nccl_matches(value: str, names: Sequence[str]) -> list[str]:
    """The interfaces NCCL would consider for ``NCCL_SOCKET_IFNAME=value``.

    NCCL's rules: comma-separated prefixes; ``=`` before the list makes them exact names; ``^``
    makes it a list to exclude (``^=docker0,lo`` excludes exactly those).
    """
    exclude = value.startswith("^")
    body = value[1:] if exclude else value
    exact = body.startswith("=")
    body = body[1:] if exact else body
    items = [item for item in body.split(",") if item]

    def listed(interface: str) -> bool:
        return any(interface == item if exact else interface.startswith(item) for item in items)

    return [interface for interface in names if listed(interface) != exclude]


def check_nccl_interfaces(facts: RankFacts, backend: str) -> Check:
    """``NCCL_SOCKET_IFNAME``: at least one interface of this host matches and has an address.

    NCCL with no matching interface fails its bootstrap ("no socket interface found"), or with
    only a down or address-less one, waits. Blocking when the doctor's collective runs on NCCL.
    """
    name = "network.NCCL_SOCKET_IFNAME"
    value = facts.comm_env.get("NCCL_SOCKET_IFNAME")
    if value is None:
        return ok(name, "not set: NCCL picks an interface itself (InfiniBand first, then others, never lo "
                  "or docker*)")
    if interface_list(value) is not None:
        return ok(name, f"NCCL_SOCKET_IFNAME={value}: malformed, reported under env.NCCL_SOCKET_IFNAME")
    matched = nccl_matches(value, list(facts.interfaces))
    usable = [interface for interface in matched if _usable(facts.interfaces[interface])]
    if not usable:
        why = "matches no interface" if not matched else f"matches only {', '.join(matched)}, with no address or down"
        return fail(name, f"NCCL_SOCKET_IFNAME={value} {why} on host {facts.host}",
                    f"{facts.host} has {_inventory(facts.interfaces)}; NCCL matches prefixes (ib matches ib0, "
                    "ib1), =name exact names, ^name excludes", blocking=backend == "nccl")
    return ok(name, f"NCCL_SOCKET_IFNAME={value}: matches {', '.join(usable)}")


def check_master_resolves(facts: RankFacts) -> Check:
    """``MASTER_ADDR`` resolves on this rank (it had to, to reach the store; a row says so)."""
    name = "network.master_resolves"
    if facts.master_resolved is None:
        return fail(name, f"MASTER_ADDR={facts.master_addr} does not resolve on {facts.host}: {facts.master_error}",
                    "use rank 0's node's IP address for MASTER_ADDR (nodescale launch scripts do)", blocking=True)
    shown = facts.master_addr if facts.master_addr == facts.master_resolved else (
        f"{facts.master_addr} -> {facts.master_resolved}")
    return ok(name, f"MASTER_ADDR {shown}")


def check_master_placement(rank0: RankFacts, facts: Mapping[int, RankFacts], missing: Sequence[int],
                           mode: str) -> Check:
    """The rendezvous address belongs to rank 0's host, and is not loopback when ranks span hosts.

    Ranks that cannot reach it never report; this row says why when that is the likely cause.
    Under torchrun's agent store (``mode == "agent"``) the address is the store's, wherever
    torchrun put it, and only the loopback rule applies.
    """
    name = "network.master_addr"
    address = rank0.master_resolved
    hosts = sorted({f.host for f in facts.values()})
    where = f"{rank0.master_addr}:{rank0.master_port}"
    if address is None:
        return fail(name, f"{where} does not resolve on rank 0's host {rank0.host}",
                    "set MASTER_ADDR to an IP address of rank 0's node", blocking=True)
    if is_loopback(address):
        # Several hosts, or several nodes of which some never came: the others look on their own node.
        if len(hosts) > 1 or (rank0.num_nodes > 1 and missing):
            return fail(name, f"{where} is a loopback address, but the ranks run on {rank0.num_nodes} nodes: "
                        "ranks on other nodes look for rank 0 on their own node",
                        "set MASTER_ADDR to rank 0's node's IP address (nodescale launch does)", blocking=True)
        return ok(name, f"{where}: loopback, every rank on {rank0.host}")
    if mode == "agent":
        return ok(name, f"{where}: torchrun's rendezvous store")
    own = {str(a) for info in rank0.interfaces.values() for a in info.get("addresses") or []}
    if own and address not in own:
        detail = (f"{where} resolves to {address}, which is not an address of rank 0's host {rank0.host} "
                  f"({', '.join(sorted(own))})")
        hint = "set MASTER_ADDR to the node that runs rank 0 (the first node of the allocation)"
        if missing:
            return fail(name, detail + "; ranks that could not report may be looking there", hint)
        return warn(name, detail + "; the ranks met anyway (NAT, a proxy or a virtual address?)", hint)
    return ok(name, f"{where}: an address of rank 0's host {rank0.host}")


def store_row(mode: str, master: str, error: str | None = None) -> Check:
    """How the rendezvous store came up on rank 0: torchrun's agent store, or rank 0's own.

    ``mode`` is ``"agent"``, ``"rank0"`` or ``"local"`` (one process, no port); ``error`` is set
    when rank 0 could not listen on the port (another job's store, a leftover process).
    """
    name = "network.master_port"
    if error:
        return fail(name, error,
                    "another process holds the port (a second job on this node, a leftover run): unset "
                    "MASTER_PORT to derive one from the job id, or pick a free one", blocking=True)
    if mode == "agent":
        return ok(name, f"{master} is torchrun's rendezvous store (the launcher's agent holds the port)")
    if mode == "local":
        return ok(name, "one process: no port needed")
    return ok(name, f"{master}: free, rank 0 listens there")
