"""The c10d store for a local job whose rank 0 is not nodescale's: a process of its own.

``nodescale launch --scheduler local -- python train.py`` runs the user's script, whose
``init_process_group("env://")`` would have its rank 0 serve the store on every interface.
Instead the launcher binds a socket on 127.0.0.1 (without importing torch), hands it to this
process, and tells the workers ``TORCHELASTIC_USE_AGENT_STORE=True``, so every rank is a
client, exactly as under torchrun's agent. The socket listens from the start, so workers that
connect before this process has imported torch wait in its backlog.

Run as ``python -m nodescale.launch.schedulers.local_store_server FD WORLD_SIZE``; it serves until SIGTERM.
"""

from __future__ import annotations

import signal
import sys
from datetime import timedelta


def serve(fd: int, world_size: int) -> None:
    """Serve a TCPStore on the listening socket ``fd`` until this process is told to stop."""
    import socket

    import torch.distributed as dist

    probe = socket.socket(fileno=fd)
    port = probe.getsockname()[1]
    probe.detach()  # the server owns the descriptor: Python must not close it
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(hours=1), master_listen_fd=fd)
    try:
        while True:
            signal.pause()
    finally:
        del store


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    serve(int(argv[0]), int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
