"""Where the c10d store listens: on the job's address, not on every interface.

torch's ``TCPStore`` binds its server to every interface (``[::]``, dual-stack) whatever host
name it is given; it listens on one address only when handed a socket already bound there
(``master_listen_fd``). nodescale does that wherever it creates the store: rank 0's store on
127.0.0.1 in local runs (or the local launcher's store process, for scripts that are not
nodescale's) and on MASTER_ADDR under srun/mpiexec. torchrun's own agent, started by the job scripts, still binds
every interface; docs/security.md says how to contain it.

The sockets are read from /proc (Linux only), so the tests see what the kernel sees.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import cli_env
from nodescale.distributed.env import DistEnv
from nodescale.distributed.process_group import STORE_BIND_VARIABLE, _job_store, bind_address, listening_store
from proc_tree import descendants

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from /proc")

WILDCARD = {"00000000", "00000000000000000000000000000000"}
LOOPBACK_HEX = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def listening(port: int | None = None, inodes: set[str] | None = None) -> set[tuple[str, int]]:
    """(address as /proc writes it, port) of listening TCP sockets, by port or by socket inode."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            if (port is None or int(port_hex, 16) == port) and (inodes is None or fields[9] in inodes):
                found.add((address, int(port_hex, 16)))
    return found


def socket_inodes(root: int) -> set[str]:
    """Socket inodes held by process ``root`` and all its descendants."""
    pids = [root, *descendants(root)]
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        inodes |= {link[len("socket:["):-1] for link in links if link.startswith("socket:[")}
    return inodes


def test_torch_alone_binds_every_interface() -> None:
    """What torch does by itself (if this changes, docs/security.md needs updating)."""
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    assert {address for address, _ in listening(store.port)} <= WILDCARD
    assert listening(store.port)


def test_listening_store_binds_one_address() -> None:
    store = listening_store("127.0.0.1", 0, None, timedelta(seconds=10), wait_for_workers=False)
    assert store is not None
    assert {address for address, _ in listening(store.port)} == {"0100007F"}
    client = dist.TCPStore("127.0.0.1", store.port, None, is_master=False, timeout=timedelta(seconds=10))
    client.set("key", "value")
    assert store.get("key") == b"value"
    # torch's c10d rendezvous backend asks for a multi-tenant server on the same port: it shares this one.
    shared = dist.TCPStore("127.0.0.1", store.port, None, is_master=True, multi_tenant=True,
                           timeout=timedelta(seconds=10))
    assert shared.get("key") == b"value"
    assert {address for address, _ in listening(store.port)} == {"0100007F"}


def test_listening_store_returns_none_when_it_cannot_bind() -> None:
    taken = listening_store("127.0.0.1", 0, None, timedelta(seconds=10), wait_for_workers=False)
    assert taken is not None
    assert listening_store("127.0.0.1", taken.port, None, timedelta(seconds=10), wait_for_workers=False) is None
    assert listening_store("192.0.2.1", 0, None, timedelta(seconds=10)) is None  # TEST-NET: not this host's


def test_bind_address_rules() -> None:
    assert bind_address("127.0.0.1", whole_job_here=True) == "127.0.0.1"
    assert bind_address("localhost", whole_job_here=True) in ("127.0.0.1", "::1")
    # Loopback for a job on several nodes: the name must mean another address elsewhere; bind all.
    assert bind_address("127.0.0.1", whole_job_here=False) is None
    assert bind_address("10.1.2.3", whole_job_here=False) == "10.1.2.3"
    assert bind_address("no-such-host.invalid", whole_job_here=False) is None


def two_rank_env(rank: int, port: int) -> DistEnv:
    return DistEnv(rank=rank, local_rank=rank, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
                   master_addr="127.0.0.1", master_port=port, source="slurm")


def free_port() -> int:
    probe = listening_store("127.0.0.1", 0, None, timedelta(seconds=5), wait_for_workers=False)
    assert probe is not None
    port = probe.port
    del probe
    return port


def test_rank0_store_under_srun_listens_on_master_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torchrun's agent, rank 0 hosts the store, on MASTER_ADDR only; rank 1 reaches it."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv(STORE_BIND_VARIABLE, raising=False)
    port = free_port()
    stores: dict[int, dist.Store | None] = {}
    # Rank 0's server waits for rank 1 to connect, so the two are made concurrently.
    server = threading.Thread(target=lambda: stores.__setitem__(0, _job_store(two_rank_env(0, port),
                                                                              timedelta(seconds=20))))
    server.start()
    deadline = time.monotonic() + 10
    while not listening(port) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert {address for address, _ in listening(port)} == {"0100007F"}
    stores[1] = _job_store(two_rank_env(1, port), timedelta(seconds=20))
    server.join(timeout=20)
    assert stores[0] is not None and stores[1] is not None
    stores[1].set("from-rank-1", "hello")
    assert stores[0].get("from-rank-1") == b"hello"


def test_torchrun_agent_store_and_opt_out_are_left_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert _job_store(two_rank_env(0, 1), timedelta(seconds=1)) is None
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    monkeypatch.setenv(STORE_BIND_VARIABLE, "any")
    assert _job_store(two_rank_env(0, 1), timedelta(seconds=1)) is None


PLAIN_SCRIPT = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")  # torch's env://, as any script does
t = torch.ones(1)
dist.all_reduce(t)
time.sleep(1)
dist.destroy_process_group()
"""

LOCAL_COMMANDS = {
    "train": ["train", "--nproc", "2", "--max-steps", "40", "--no-progress", "--out", "run"],
    "doctor": ["doctor", "--nproc", "2", "--out", "doctor"],
    "launch": ["launch", "--scheduler", "local", "--nproc-per-node", "2", "--", sys.executable, "plain.py"],
}


@pytest.mark.multiproc
@pytest.mark.parametrize("what", sorted(LOCAL_COMMANDS))
def test_local_runs_listen_on_loopback_only(tmp_path: Path, what: str) -> None:
    """While a local run lasts, nothing in its process tree listens on every interface.

    ``train`` and ``doctor``: rank 0 is nodescale's and binds 127.0.0.1. ``launch`` runs a
    plain script whose ``env://`` would make its rank 0 bind every interface: the launcher's
    store process serves the store on 127.0.0.1 instead.
    """
    (tmp_path / "plain.py").write_text(PLAIN_SCRIPT)
    process = subprocess.Popen([sys.executable, "-m", "nodescale", *LOCAL_COMMANDS[what]], cwd=tmp_path,
                               env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[tuple[str, int]] = set()
    try:
        while process.poll() is None:
            seen |= listening(inodes=socket_inodes(process.pid))
            time.sleep(0.02)
    finally:
        output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output
    # The store and gloo's sockets; gloo binds the address the host name resolves to (or
    # GLOO_SOCKET_IFNAME's), never the wildcard.
    assert seen, "no listening socket seen while the run lasted"
    assert not {entry for entry in seen if entry[0] in WILDCARD}, f"listening on every interface: {seen}"
    assert {entry for entry in seen if entry[0] in LOOPBACK_HEX}, seen
