"""A heartbeat watchdog: a job whose rank stops making progress fails, naming it, instead of hanging.

Every rank runs one thread. It publishes the rank's heartbeat in the c10d store every
``interval`` seconds (a counter, the last step, whether the rank is training, its host and where
its main thread is) and reads the heartbeat of one other rank, its ring neighbour
``(rank + 1) % world``: every rank is watched by exactly one other, and the store sees a constant
load per rank however large the job. Two things make the watcher end the job:

* the neighbour's counter has not moved for ``timeout`` seconds: its process no longer runs
  (stopped, dead, its host gone, or stuck holding the GIL);
* the neighbour is training but its step has not moved for ``timeout`` seconds (a deadlock,
  a rank waiting forever on I/O or on a collective another rank never joined).

The watcher prints one line naming the rank, its host and its last step (for a rank that is
alive but stuck, also what every rank's heartbeat says: who is behind, or where each group of
ranks waits when all are at the same step, which a deadlock between two different collectives
looks like, and where the neighbour may only be waiting for the culprit), and leaves with
:data:`EXIT_HANG` through ``os._exit``: the main thread may be blocked in a collective that would
otherwise only end at the collective timeout. The launcher (torchrun, srun --kill-on-bad-exit)
then stops the other ranks. Times are measured by each process on its own monotonic clock, so
hosts' clocks need not agree. Long legitimate pauses (evaluation, checkpoints, the first step
with its compilation) are announced with :meth:`Watchdog.paused` and only the counter is
checked then. Threads blocked in a gloo or NCCL wait release the GIL, so this thread runs.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from nodescale.distributed.process_group import Runtime
from nodescale.distributed.rank_labels import ranks_label
from nodescale.stop_signals import EXIT_HANG

KEY = "nodescale-heartbeat/{rank}"
# Reading every rank's heartbeat costs the store one request per rank per watcher, and in a
# deadlock every watcher fires at once: above this many ranks the report names the neighbour only.
SUMMARY_MAX_RANKS = 256


def interval_for(timeout_s: float) -> float:
    """How often to beat and look: often enough to notice within ~20% of the timeout, at most every 5 s."""
    return max(0.2, min(5.0, timeout_s / 5))


def open_store(timeout_s: float) -> Any:
    """A client of the process group's store with a short timeout of its own.

    The group's own client waits as long as the collective timeout; a watchdog that waited that
    long on a frozen store host could not report anything. Falls back to the group's store.
    """
    store = dist.distributed_c10d._get_default_store()
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        try:
            return dist.TCPStore(inner.host, inner.port, is_master=False, timeout=timedelta(seconds=timeout_s),
                                 wait_for_workers=False)
        except (RuntimeError, ValueError):
            pass
    return store


class Watchdog:
    """The heartbeat thread of one rank; ``beat(step)`` from the training loop is all it costs there."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float,
                 on_hang: Callable[[str], None] | None = None, host: str | None = None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.interval = interval_for(timeout_s)
        self.host = host or socket.gethostname()
        self.on_hang = on_hang or _exit_hang
        self.step = -1
        self._progress_at = time.monotonic()
        self._state = "starting"  # starting (until the first step), training, paused or done
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="nodescale-watchdog", daemon=True)

    # ------------------------------------------------------------- main thread
    def start(self) -> None:
        self._publish(0)
        self._thread.start()

    def beat(self, step: int) -> None:
        """A step was completed: attribute writes only, the thread publishes them."""
        self.step = step
        self._progress_at = time.monotonic()
        if self._state == "starting":
            self._state = "training"

    @contextmanager
    def paused(self) -> Iterator[None]:
        """A long pause that is progress (evaluation, checkpoint): only liveness is watched."""
        before, self._state = self._state, "paused"
        try:
            yield
        finally:
            self._progress_at = time.monotonic()
            self._state = before

    def stop(self) -> None:
        """Say this rank is done (its watcher stops checking it), and end the thread."""
        self._state = "done"
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval + 1)
        try:
            self._publish(-1)
        except Exception:  # noqa: BLE001 - the store may be gone already; nothing to report then
            pass

    # ----------------------------------------------------------------- thread
    def _publish(self, count: int) -> None:
        beat = {"count": count, "step": self.step, "state": self._state, "host": self.host,
                "pid": os.getpid(), "idle_s": round(time.monotonic() - self._progress_at, 1),
                "where": self._where()}
        self.store.set(KEY.format(rank=self.rank), json.dumps(beat))

    def _where(self) -> str:
        """The innermost frame of the main thread: where a stuck rank is stuck."""
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        if frame is None:
            return "?"
        last = traceback.extract_stack(frame, limit=1)[-1]
        return f"{last.filename}:{last.lineno} in {last.name}"

    def _read_beat(self, rank: int) -> dict[str, Any] | None:
        """``rank``'s last published heartbeat; None before it published one."""
        key = KEY.format(rank=rank)
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _run(self) -> None:
        neighbour = (self.rank + 1) % self.world_size
        count = 0
        seen: dict[str, Any] | None = None
        seen_at = time.monotonic()
        while not self._stop.wait(self.interval):
            count += 1
            try:
                self._publish(count)
                beat = self._read_beat(neighbour)
            except Exception as exc:  # noqa: BLE001 - a store that does not answer is a hang too
                if time.monotonic() - seen_at > self.timeout_s and not self._stop.is_set():
                    self.on_hang(f"nodescale: hang: the rendezvous store did not answer rank {self.rank} on "
                                 f"{self.host} for {self.timeout_s:.0f} s ({exc}); its host (rank 0's or the "
                                 "launcher's node) may be stuck")
                    return
                continue
            now = time.monotonic()
            if beat is None:  # the neighbour has not started its watchdog yet
                continue
            if beat["state"] == "done":
                return
            if seen is None or beat["count"] != seen["count"]:
                seen, seen_at = beat, now
            message = self._verdict(neighbour, beat, now - seen_at)
            if message and not self._stop.is_set():
                self.on_hang(message)
                return

    def _verdict(self, rank: int, beat: dict[str, Any], silent_s: float) -> str | None:
        step = beat["step"] if beat["step"] >= 0 else "none yet"
        who = f"rank {rank} on host {beat['host']} (pid {beat['pid']}, last step {step})"
        if silent_s > self.timeout_s:
            return (f"nodescale: hang: {who} stopped responding: no heartbeat for {silent_s:.0f} s "
                    f"(heartbeat timeout {self.timeout_s:g} s); its process is stopped, dead or stuck; "
                    f"reported by rank {self.rank} on {self.host}")
        if beat["state"] == "training" and beat["idle_s"] > self.timeout_s:
            everyone = ""
            if self.world_size <= SUMMARY_MAX_RANKS:
                everyone = f"; all ranks: {summarise_ranks(self._all_beats(), self.world_size)}"
            return (f"nodescale: hang: {who} made no progress for {beat['idle_s']:.0f} s (heartbeat timeout "
                    f"{self.timeout_s:g} s); its main thread is at {beat['where']}{everyone}; "
                    f"reported by rank {self.rank} on {self.host}")
        return None

    def _all_beats(self) -> dict[int, dict[str, Any]]:
        """Every rank's last published heartbeat (read once, when a hang is found); what could be read."""
        beats: dict[int, dict[str, Any]] = {}
        for rank in range(self.world_size):
            try:
                beat = self._read_beat(rank)
            except Exception:  # noqa: BLE001 - the store is failing: report what was read
                break
            if beat is not None:
                beats[rank] = beat
        return beats


def summarise_ranks(beats: dict[int, dict[str, Any]], world_size: int, max_places: int = 4) -> str:
    """Who is behind, or where each group waits: one clause over every rank's heartbeat.

    A rank at a lower step than the others is what they wait for. When every rank is at the same
    step the ranks are grouped by where their main threads are: two groups in two different
    collectives is a deadlock, and the smaller group is usually the one that went astray.
    """
    live = {rank: beat for rank, beat in beats.items() if beat.get("state") != "done"}
    parts = []
    if live:
        steps = {rank: beat["step"] for rank, beat in live.items()}
        low, high = min(steps.values()), max(steps.values())
        if low < high:
            behind = sorted(rank for rank, step in steps.items() if step == low)
            ahead = [step for step in steps.values() if step > low]
            at = _step(high) if min(ahead) == high else f"steps {min(ahead)}-{high}"
            parts.append(f"{ranks_label(behind)} behind at {_step(low)} ({_hosts(behind, live)}, main thread at "
                         f"{live[behind[0]]['where']}), the other {len(ahead)} at {at}")
        else:
            places: dict[str, list[int]] = {}
            for rank in sorted(live):
                places.setdefault(live[rank]["where"], []).append(rank)
            groups = sorted(places.items(), key=lambda item: (len(item[1]), item[1][0]))  # smallest group first
            shown = "; ".join(f"{ranks_label(ranks)} at {where}" for where, ranks in groups[:max_places])
            more = f"; {len(groups) - max_places} more places" if len(groups) > max_places else ""
            parts.append(f"every rank at {_step(low)}: {shown}{more}")
    missing = [rank for rank in range(world_size) if rank not in beats]
    if missing:
        parts.append(f"no heartbeat from {ranks_label(missing)}")
    return "; ".join(parts) or "no heartbeat could be read"


def _step(step: int) -> str:
    return f"step {step}" if step >= 0 else "no step yet"


def _hosts(ranks: list[int], beats: dict[int, dict[str, Any]], limit: int = 3) -> str:
    hosts = list(dict.fromkeys(beats[rank]["host"] for rank in ranks))
    more = f" and {len(hosts) - limit} more" if len(hosts) > limit else ""
    return ("host " if len(hosts) == 1 else "hosts ") + ", ".join(hosts[:limit]) + more


def _exit_hang(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_HANG)


def start_watchdog(runtime: Runtime, timeout_s: float) -> Watchdog | None:
    """Every rank's heartbeat thread, when there are other ranks to watch and a timeout is set."""
    if not runtime.has_process_group or runtime.world_size < 2 or timeout_s <= 0:
        return None
    watchdog = Watchdog(open_store(timeout_s), runtime.rank, runtime.world_size, timeout_s)
    watchdog.start()
    return watchdog
