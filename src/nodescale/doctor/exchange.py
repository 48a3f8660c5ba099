"""Rank 0 and the others talk through the rendezvous store, with a deadline on every wait.

No process group is needed: facts go up, the plan and the verdict come down, as JSON values
of a ``torch.distributed`` store. Which store is the launcher's business, mirrored from
``torch.distributed.rendezvous``'s ``env://`` handler:

* under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) every rank is a client of the
  agent's store at ``MASTER_ADDR:MASTER_PORT``; the keys carry the run id and restart count,
  because that store outlives one attempt;
* otherwise (srun, mpiexec, hand-set variables) rank 0 starts the store there, as
  ``init_process_group("env://")`` would. It is multi-tenant, so the process group that
  :func:`nodescale.distributed.process_group.start` creates later in the same process reuses the
  server instead of failing to bind the port a second time;
* a single process uses an in-memory store: no port, so none can clash.

Rank 0 never blocks on one rank: it polls a counter until every rank reported or the
deadline passed, then reads what is there and names the ranks that are not.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from nodescale.distributed.env import DistEnv

POLL_S = 0.05
KEY_PREFIX = "nodescale-doctor"


class StoreUnavailable(Exception):
    """This rank could not start or reach the rendezvous store; ``listening`` is True when it
    was rank 0 failing to listen (the port is taken), False when a rank could not connect."""

    def __init__(self, message: str, listening: bool) -> None:
        super().__init__(message)
        self.listening = listening


@dataclass
class Exchange:
    """A store shared by all ranks, and who this rank is."""

    store: Any  # torch.distributed.Store
    rank: int
    world_size: int
    mode: str  # "agent", "rank0" or "local"

    def publish(self, kind: str, payload: Any) -> None:
        """Post this rank's ``kind`` (facts, result) for rank 0, and count it."""
        self.store.set(f"{kind}/{self.rank}", json.dumps(payload))
        self.store.add(f"{kind}/count", 1)

    def claim(self) -> None:
        """Count this process as its rank: two processes with one rank make the count 2."""
        self.store.add(f"claim/{self.rank}", 1)

    def claims(self, ranks: Iterable[int]) -> dict[int, int]:
        """How many processes claimed each of ``ranks`` (adding 0 reads a counter)."""
        return {rank: int(self.store.add(f"claim/{rank}", 0)) for rank in ranks}

    def gather(self, kind: str, timeout_s: float) -> tuple[dict[int, Any], list[int]]:
        """Rank 0: every rank's ``kind`` that arrived within ``timeout_s``, and the ranks that did not."""
        deadline = time.monotonic() + timeout_s
        while int(self.store.add(f"{kind}/count", 0)) < self.world_size and time.monotonic() < deadline:
            time.sleep(POLL_S)
        found: dict[int, Any] = {}
        missing = []
        for rank in range(self.world_size):
            key = f"{kind}/{rank}"
            if self.store.check([key]):
                found[rank] = json.loads(self.store.get(key))
            else:
                missing.append(rank)
        return found, missing

    def announce(self, key: str, payload: Any) -> None:
        """Rank 0: tell every rank ``payload`` under ``key``."""
        self.store.set(key, json.dumps(payload))

    def leave(self, timeout_s: float) -> None:
        """A rank other than 0: wait for rank 0's "done", then say so and touch the store no more.

        Rank 0 waits for these before it exits (:meth:`wait_until_left`): when rank 0 hosts
        the store, a rank still reading from it as rank 0 exits gets a torn connection (and
        torch logs a C++ stack trace for it).
        """
        try:
            self.store.wait(["done"], timedelta(seconds=timeout_s))
            self.store.add("left", 1)
        except Exception:  # rank 0 is gone already; nothing left to tell it
            pass

    def wait_until_left(self, others: int, timeout_s: float) -> None:
        """Rank 0: until ``others`` ranks (those that reported) called :meth:`leave`, or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while int(self.store.add("left", 0)) < others and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def wait_for(self, key: str, timeout_s: float) -> Any | None:
        """What rank 0 announced under ``key``; ``None`` if nothing came within ``timeout_s``."""
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
            return json.loads(self.store.get(key))
        except Exception:  # DistStoreError on timeout, a network error when rank 0 is gone
            return None


def connect(env: DistEnv, timeout_s: float, environ: Mapping[str, str] | None = None) -> Exchange:
    """The store this job's ranks share (see the module docstring). Raises :class:`StoreUnavailable`."""
    import torch.distributed as dist

    environ = os.environ if environ is None else environ
    timeout = timedelta(seconds=timeout_s)
    agent = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    where = f"{env.master_addr}:{env.master_port}"
    if env.world_size == 1 and not agent:
        return Exchange(dist.HashStore(), env.rank, env.world_size, "local")
    listening = env.rank == 0 and not agent
    try:
        if agent:
            store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
            run = f"{environ.get('TORCHELASTIC_RUN_ID', 'run')}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            prefix = f"{KEY_PREFIX}/{run}"
        else:
            # wait_for_workers=False: rank 0 must not block here until everyone connects; it
            # waits in gather() instead, where it can name who is missing. Rank 0 listens on
            # MASTER_ADDR only where it can (see docs/security.md), as training's store does.
            from nodescale.distributed.process_group import rank0_store

            own = rank0_store(env, timeout, wait_for_workers=False) if listening else None
            store = own or dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=listening,
                                         timeout=timeout, wait_for_workers=False, multi_tenant=True)
            prefix = KEY_PREFIX
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if listening:
            raise StoreUnavailable(f"rank 0 could not listen on {where}: {text}", listening=True) from exc
        raise StoreUnavailable(f"could not reach the rendezvous store at {where} within {timeout_s:g} s: {text}",
                               listening=False) from exc
    return Exchange(dist.PrefixStore(prefix, store), env.rank, env.world_size, "agent" if agent else "rank0")
