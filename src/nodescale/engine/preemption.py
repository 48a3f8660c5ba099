"""Stop every rank at the same step boundary when one of them is told to stop (preemption, wall time).

A signal handler only records the signal. At a step boundary each rank contributes what it
received to an all-reduce (MAX of the signal number), so all ranks decide together, at the same
step, even when the scheduler signalled only some of them (srun forwards to the tasks of one node
at a time; torchrun's workers may see it before their agent). The all-reduce runs on a gloo group
of its own over a CPU tensor, so under NCCL it costs no device synchronisation, and it is
asynchronous: started at one agreement, waited for at the next, so the check never waits on the
network in the step's critical path. Agreements come every step until the timing warm-up ends, then
every :func:`stop_check_interval` steps (about :data:`STOP_CHECK_SECONDS`): a stop comes within two.

Under nodescale's local launcher SIGTERM is also the signal of the launcher's death; a rank
then ends at once instead (:mod:`nodescale.launcher_death`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from nodescale.atomic_files import write_text_atomic
from nodescale.distributed.process_group import Runtime
from nodescale.launcher_death import end_with_launcher, launcher_gone, watch_launcher
from nodescale.stop_signals import REQUEUE_FILE_VARIABLE, requeue_marker

log = logging.getLogger(__name__)


class StopRequest:
    """Signal handlers plus the per-step agreement; :meth:`close` puts the old handlers back."""

    def __init__(self, signals: list[signal.Signals], distributed: bool, timeout_s: float = 600.0) -> None:
        """``timeout_s``: the collective timeout of the check's group (new groups otherwise get torch's
        30-minute default, not the job's, and a rank stuck in the check would wait that long)."""
        self.received = 0  # the last stop signal this process received (0: none)
        self.agreed_signal = 0  # the signal every rank agreed to stop on (0: none yet)
        self._previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            if signals:
                watch_launcher()  # the handlers catch the launcher's death signal: watch for its death instead
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        elif signals:
            log.warning("not in the main thread: stop signals keep their default actions")
        # A group of its own, always gloo: the check runs on the CPU whatever the training backend.
        self._group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                       if distributed and signals else None)
        self._pending: tuple[Any, torch.Tensor] | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if launcher_gone():  # the launcher's death signal, not a stop request: no one is left to stop for
            end_with_launcher()
        # Only a flag: the step in progress finishes, and everything else happens at its end.
        self.received = signum

    def agreed(self) -> bool:
        """At a step boundary, on every rank: whether all ranks now stop (the same answer on each)."""
        if self._group is None:
            self.agreed_signal = self.received
            return bool(self.received)
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            self._pending = None
            if flag.item() > 0:
                self.agreed_signal = int(flag.item())
                return True
        flag = torch.tensor([self.received], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return False

    def barrier(self) -> None:
        """Every rank: wait until all got here, on the check's own gloo group (no device synchronisation)."""
        if self._group is not None:
            dist.barrier(group=self._group)

    def close(self, wait: bool = True) -> None:
        """Finish the pending check (every rank started it) and restore the previous handlers.

        ``wait=False`` after a failure: another rank may never join the pending check.
        """
        if self._pending is not None and wait:
            self._pending[0].wait()
        self._pending = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.agreed_signal).name if self.agreed_signal else "none"


def write_requeue_file(step: int, run_dir: Path | None = None) -> Path | None:
    """Rank 0, after the checkpoint of ``step``: tell the job script (or the local launcher) to requeue.

    The file is the evidence they require (an exit code alone proves no checkpoint); its step lets a
    job script refuse a requeue that made no progress. Written whole (a temporary file renamed).
    """
    target = os.environ.get(REQUEUE_FILE_VARIABLE, "").strip()
    if not target:
        return None
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, requeue_marker(step, str(run_dir) if run_dir is not None else None))
    return path


# How often the ranks agree on a stop, in the slowest rank's step time: an agreement costs a collective (a
# network round trip, and the threads it wakes on a busy node), which small steps would pay at every step.
STOP_CHECK_SECONDS = 0.2
MAX_STOP_CHECK_STEPS = 100


def stop_check_interval(runtime: Runtime, steps: int, seconds: float) -> int:
    """Every rank, once, at the end of the timing warm-up (a collective, so also a barrier): agree every how
    many steps, from the slowest rank's ``seconds`` over ``steps`` warm-up steps."""
    per_step = torch.tensor([seconds / steps if steps > 0 else 0.0], dtype=torch.float64, device=runtime.device)
    if runtime.has_process_group:
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    return steps_between_checks(float(per_step.item()))


def steps_between_checks(step_seconds: float) -> int:
    """About :data:`STOP_CHECK_SECONDS` of steps of ``step_seconds``: 1 to :data:`MAX_STOP_CHECK_STEPS`
    (1 when unknown)."""
    if not step_seconds > 0:
        return 1
    return max(1, min(MAX_STOP_CHECK_STEPS, int(STOP_CHECK_SECONDS / step_seconds)))
