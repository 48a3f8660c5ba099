"""A free TCP port for a local job's rendezvous, chosen where other programs do not take ports,
and the listening socket a c10d store is handed (torch-free: the local launcher uses both).

The launcher picks the port and rank 0 binds it a second or two later, once it has imported
torch. A port the kernel hands out on its own (``bind(0)``, every outgoing connection) comes
from the ephemeral range, so in that gap any connection on the host could take it; gloo alone
opens one per pair of ranks. A port below that range is only ever taken by a program that
names it. Below 30000 are the ports launchers name (torchrun's, Accelerate's and DeepSpeed's
29500; nodescale's own per-job ports, 15000-29999, see ``dist.env``), so the pick is a random
one of the ~2,700 between 30000 and the ephemeral range.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 30000


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for automatically assigned ports (Linux's default where it cannot be read)."""
    try:
        low, high = (int(part) for part in path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str, attempts: int = 50) -> int:
    """A port on ``host`` that nothing listens on now, below the ephemeral range where there is room.

    Falls back to a kernel-assigned port when no candidate below the range can be bound.
    """
    low, _ = ephemeral_range()
    candidates = list(range(LOWEST_PORT, low))
    for port in random.sample(candidates, min(attempts, len(candidates))):
        if _can_bind(host, port):
            return port
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: the kernel picks) and listening; OSError if it cannot bind.

    Handed to a ``TCPStore`` (``master_listen_fd``), it makes the store listen on ``host`` only.
    """
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch does: restarts reuse the port
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
