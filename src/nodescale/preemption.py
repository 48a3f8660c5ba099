"""Checkpoint and requeue at the wall time, for scripts that do not use ``nodescale.init``.

::

    import nodescale.preemption as preemption

    for step, batch in enumerate(loader, start=first_step):
        ...                                   # the user's own step
        if preemption.requested():            # every rank, at every step boundary
            save_checkpoint(step)             # the user's own save (rank 0 or every rank)
            preemption.requeue(step)          # the marker, then exit code 3: the job is requeued

The same mechanism as ``ctx.should_stop()`` and ``ctx.exit_for_requeue()``
(:class:`~nodescale.engine.preemption.StopRequest`): the first call installs handlers for the stop
signals (SIGTERM, SIGUSR1, SIGUSR2: the job script's warning, Slurm's and the local launcher's stop)
and, where a process group exists, every rank agrees on the same step. A job script requeues
only on the marker :func:`requeue` writes, never on an exit code alone.
:func:`hf_trainer_callback` does both for a Hugging Face ``Trainer``.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

from nodescale.stop_signals import DEFAULT as SIGNALS
from nodescale.stop_signals import EXIT_REQUEUE, parse_signals

_stop: Any = None  # the process's StopRequest, made at the first requested()
_grouped = False  # whether it agrees across a process group


def requested() -> bool:
    """Whether every rank now stops: call it on every rank at every step boundary (the same calls on each).

    The first call installs the signal handlers: make it early (before the first step). With a process
    group (``torch.distributed`` initialised), the answer is agreed across ranks and comes one call after
    the signal; call it after ``init_process_group``.
    """
    global _stop, _grouped
    import torch.distributed as dist

    from nodescale.engine.preemption import StopRequest

    grouped = dist.is_available() and dist.is_initialized()
    if _stop is None or (grouped and not _grouped):
        received = _stop.received if _stop is not None else 0
        if _stop is not None:
            _stop.close(wait=False)
        _stop, _grouped = StopRequest(parse_signals(SIGNALS), grouped), grouped
        _stop.received = received  # a signal before the process group existed still counts
    return bool(_stop.agreed())


def requeue(step: int) -> NoReturn:
    """After the checkpoint of ``step`` is written, on every rank: ask the job script to requeue, and exit 3.

    Rank 0 writes the requeue marker with ``step`` (a requeued run that stops again at the same step is not
    requeued again: it made no progress); the ranks then meet once, so that none exits (and makes srun end
    the others) before rank 0's checkpoint and marker are written.
    """
    import torch.distributed as dist

    from nodescale.engine.preemption import write_requeue_file

    grouped = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if grouped else int(os.environ.get("RANK", "0") or 0)
    if rank == 0:
        marker = write_requeue_file(int(step))
        print(f"nodescale: stopped at step {step} for requeue" + (f"; requeue marker {marker}" if marker else ""),
              file=sys.stderr, flush=True)
    if _stop is not None:
        _stop.barrier()
        _stop.close()
    elif grouped:
        dist.barrier()
    if grouped:
        dist.destroy_process_group()
    raise SystemExit(EXIT_REQUEUE)


def hf_trainer_callback() -> Any:
    """A ``transformers.TrainerCallback``: on the stop signal, save a checkpoint at this step and requeue.

    ``Trainer(..., callbacks=[nodescale.preemption.hf_trainer_callback()])``; resume with
    ``trainer.train(resume_from_checkpoint=get_last_checkpoint(out) if os.path.isdir(out) else None)``
    (``transformers.trainer_utils``; it returns None when ``out`` holds no checkpoint yet).
    """
    from transformers import TrainerCallback

    class RequeueOnStop(TrainerCallback):  # type: ignore[misc]
        """Asks the Trainer to save and stop at the agreed step, then requeues once the save is written."""

        stopping = False

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if requested():
                self.stopping = control.should_save = control.should_training_stop = True
            return control

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if self.stopping:
                requeue(state.global_step)
            return control

    return RequeueOnStop()
