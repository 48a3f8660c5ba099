"""What this host looks like to the network and the scheduler: interfaces, CPUs, name lookups.

Only the standard library; every probe returns what it found or ``None``/an error text and
never raises, because a doctor that crashes on the broken machine it is meant to diagnose
reports nothing. Name lookups run with a deadline: a resolver that waits on an unreachable
DNS server must not hang the check.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import threading
from pathlib import Path

from nodescale.distributed.env import resolve_ipv4_first

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_IF_INET6 = Path("/proc/net/if_inet6")
_SYS_NET = Path("/sys/class/net")


def interfaces() -> dict[str, dict[str, object]]:
    """``{name: {"addresses": [...], "state": "up" | "down" | "unknown"}}`` for every interface.

    Addresses are IPv4 (ioctl) then IPv6 (``/proc/net/if_inet6``, link-local ones left out since
    gloo and NCCL cannot use them without a scope). On systems without these, lists are empty.
    """
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return {}
    ipv6 = _ipv6_addresses()
    found: dict[str, dict[str, object]] = {}
    for name in names:
        addresses = [address for address in [_ipv4_address(name)] if address]
        addresses += ipv6.get(name, [])
        found[name] = {"addresses": addresses, "state": _operstate(name)}
    return found


def _ipv4_address(name: str) -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    except OSError:  # no IPv4 address (or not Linux)
        return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_addresses() -> dict[str, list[str]]:
    result: dict[str, list[str]] = {}
    try:
        lines = _IF_INET6.read_text().splitlines()
    except OSError:
        return result
    for line in lines:
        fields = line.split()
        if len(fields) < 6:
            continue
        address = ipaddress.IPv6Address(int(fields[0], 16))
        if not address.is_link_local:
            result.setdefault(fields[5], []).append(str(address))
    return result


def _operstate(name: str) -> str:
    try:
        state = (_SYS_NET / name / "operstate").read_text().strip()
    except OSError:
        return "unknown"
    # Loopback and some virtual interfaces say "unknown" while they carry traffic.
    return state if state in ("up", "down") else "unknown"


def cpu_affinity() -> list[int]:
    """The CPUs this process may run on (all CPUs where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def resolve(host: str, timeout_s: float) -> tuple[str | None, str | None]:
    """``(address, None)`` for ``host`` (IPv4 first, as nodescale's launcher resolves it), or
    ``(None, why)`` when it does not resolve within ``timeout_s`` seconds.

    The lookup runs in a daemon thread: a resolver stuck on an unreachable DNS server is left
    behind, and neither this call nor the interpreter's exit waits for it (a thread pool's
    worker would be joined at exit).
    """
    outcome: dict[str, str] = {}

    def look_up() -> None:
        try:
            outcome["address"] = resolve_ipv4_first(host)
        except (OSError, UnicodeError, ValueError) as exc:
            outcome["error"] = str(exc) or type(exc).__name__

    thread = threading.Thread(target=look_up, name=f"resolve {host}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, f"no answer from the resolver within {timeout_s:g} s"
    return outcome.get("address"), outcome.get("error")


def outbound_address(target: str, port: int) -> str | None:
    """The local address this host would use to reach ``target`` (no packet is sent: a UDP
    socket's connect only picks the route)."""
    try:
        family = socket.AF_INET6 if ":" in target else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((target, port or 9))
            return str(sock.getsockname()[0])
    except OSError:
        return None


def is_loopback(address: str) -> bool:
    """Whether ``address`` is a loopback address (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
