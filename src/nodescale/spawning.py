"""``nodescale.spawn``: run a function on N local processes from a notebook or a script.

::

    def train(ctx, epochs):
        model, optimizer = ctx.prepare(model, optimizer)
        ...
        return ctx.mean(loss)

    loss = nodescale.spawn(train, 3, nproc=2)      # rank 0's return value

Each process is forked from the caller, as Accelerate's ``notebook_launcher`` does, because a
function defined in a notebook lives in the kernel's ``__main__``, which a fresh interpreter
cannot import. The children get exactly the environment nodescale's launcher gives its
workers (torchrun's variables, rank 0 serving the store on 127.0.0.1), then call
``nodescale.init(**init_options)``; the caller's ``os.environ`` is never touched.

The module is not named ``spawn``: importing a submodule ``nodescale.spawn`` would replace the
function ``nodescale.spawn`` on the package with the module.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from contextlib import suppress
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from nodescale.distributed.env import LOOPBACK
from nodescale.distributed.ports import free_port
from nodescale.errors import UserError
from nodescale.launch.schedulers.local_launcher import describe_failure
from nodescale.launch.schedulers.local_worker_group import die_with_parent, worker_environment

# How long ranks told to stop (after another failed) get before SIGKILL: they only need to exit,
# not to checkpoint, and the user is waiting in front of the cell.
STOP_GRACE_SECONDS = 3.0
# After the first failure, how long the other ranks may still report or exit before they are
# stopped: long enough to see that a rank which died silently caused another's error.
SETTLE_SECONDS = 1.0


class SpawnError(RuntimeError):
    """A rank of :func:`spawn` raised, or ended before its function returned.

    ``rank``: the first rank that failed; ``exitcode``: its exit code (negative: the signal
    that ended it; None if it was still running); ``remote_traceback``: the traceback it
    raised, formatted in the child ("" when it died without one).
    """

    def __init__(self, message: str, rank: int, exitcode: int | None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback


def spawn(fn: Callable[..., Any], *args: Any, nproc: int = 2, **init_options: Any) -> Any:
    """Run ``fn(ctx, *args)`` on ``nproc`` local processes; return rank 0's return value.

    Every process calls ``nodescale.init(**init_options)`` and passes the ``Context`` to
    ``fn``, then leaves the process group. The other ranks' return values are dropped. When a
    rank raises, the others are stopped and :class:`SpawnError` carries that rank's
    traceback; a rank that exits or is killed is named with its exit code or signal.

    The processes are forked (functions defined in a notebook work), so CUDA must not have
    been initialised in the calling process: do all GPU work inside ``fn``.
    """
    _check_can_spawn(fn, nproc)
    context = multiprocessing.get_context("fork")
    port = free_port(LOOPBACK)
    run_id = uuid.uuid4().hex
    children: dict[int, BaseProcess] = {}
    readers: dict[int, Connection] = {}
    try:
        # nproc=1 also runs in a child, not in this process: in-process, init would bind this
        # process to a GPU (initialising CUDA) and start a group, and no later spawn could fork.
        for rank in range(nproc):
            env = worker_environment(os.environ, rank, nproc, port, run_id, {})
            reader, writer = context.Pipe(duplex=False)
            child = context.Process(target=_run_rank, args=(fn, args, init_options, env, rank, writer),
                                    name=f"nodescale-rank-{rank}")
            child.start()
            writer.close()  # the child holds the only writing end now
            children[rank], readers[rank] = child, reader
        return _result_of(children, readers, nproc)
    finally:
        _stop(children)  # nothing is left running, whatever happened (Ctrl-C included)
        for reader in readers.values():
            reader.close()


def _check_can_spawn(fn: Callable[..., Any], nproc: int) -> None:
    """Refuse, before any process starts, what cannot work in a forked child."""
    if not callable(fn):
        raise UserError(f"nodescale.spawn({fn!r})", "the first argument must be a function fn(ctx, *args)")
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise UserError(f"nproc={nproc!r}", "must be a whole number of processes, 1 or more")
    if "fork" not in multiprocessing.get_all_start_methods():
        raise UserError(f"nodescale.spawn on {sys.platform}", "needs the fork start method, which this platform lacks",
                        "put the training in a script and run it with `nodescale launch` or torchrun")
    import torch
    import torch.distributed as dist

    import nodescale.api  # noqa: F401  imported once here, not once per child

    if torch.cuda.is_initialized():
        raise UserError("CUDA is already initialised in this process",
                        "a forked process cannot use CUDA once its parent has",
                        "restart the kernel and do every GPU operation (.cuda(), .to('cuda'), torch.cuda.*) "
                        "inside the spawned function")
    if dist.is_available() and dist.is_initialized():
        raise UserError("a process group is already up in this process",
                        "the spawned processes would inherit it instead of forming their own",
                        "call ctx.close() (or dist.destroy_process_group()) before nodescale.spawn")


def _run_rank(fn: Callable[..., Any], args: tuple[Any, ...], init_options: dict[str, Any],
              env: dict[str, str], rank: int, writer: Connection) -> None:
    """In the forked child: become rank ``rank``, run ``fn`` and send back one message."""
    os.setsid()  # a session of its own: the parent ends it and its DataLoader workers together
    die_with_parent()  # a kernel restarted or killed takes its ranks with it
    signal.signal(signal.SIGINT, signal.default_int_handler)  # not the kernel's handlers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    import torch

    # GNU OpenMP is not fork-safe: once the parent ran a parallel region, a child asking for
    # several threads waits forever for threads that were not forked.
    torch.set_num_threads(1)
    in_fn = False
    try:
        from nodescale import api

        with api.init(**init_options) as ctx:
            in_fn = True
            try:
                result = fn(ctx, *args)
            except BaseException as exc:
                # Sent before the group is abandoned, so its time stamp precedes the other ranks'
                # "connection closed" errors that leaving causes.
                _send_failure(writer, exc)
                raise
            in_fn = False
        try:
            _send(writer, ("ok", result if rank == 0 else None))
        except Exception as exc:
            raise TypeError(f"the return value of {getattr(fn, '__name__', 'fn')} cannot be sent back "
                            f"(it is pickled): {exc}") from exc
    except BaseException as exc:
        if not in_fn:  # init refused or close failed; a UserError from init is re-raised as it is
            _send_failure(writer, exc, exc if isinstance(exc, UserError) else None)
        sys.exit(1)
    finally:
        writer.close()


def _send_failure(writer: Connection, exc: BaseException, user_error: UserError | None = None) -> None:
    # Without this module's own frame (_run_rank), the traceback starts at the user's function.
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    text = "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
    summary = traceback.format_exception_only(exc)[-1].strip()
    with suppress(OSError):
        # The system-wide monotonic clock orders reports that arrive together.
        _send(writer, ("error", summary, text, time.monotonic(), user_error))


def _result_of(children: dict[int, BaseProcess], readers: dict[int, Connection], nproc: int) -> Any:
    """Rank 0's value once every rank has exited cleanly; the error of the failure that came first otherwise."""
    messages: dict[int, tuple[Any, ...]] = {}
    running = set(children)
    settled_by: float | None = None  # set at the first failure
    while running and (settled_by is None or time.monotonic() < settled_by):
        waiting = [readers[rank] for rank in running if rank not in messages]
        wait(waiting + [children[rank].sentinel for rank in running],
             None if settled_by is None else max(0.0, settled_by - time.monotonic()))
        for rank in sorted(running):
            if rank not in messages:
                message = _receive(readers[rank])
                if message is not None:
                    messages[rank] = message
            if not children[rank].is_alive():
                running.discard(rank)
                if rank not in messages:  # it may have written just before exiting
                    messages[rank] = _receive(readers[rank]) or ("lost", time.monotonic())
        if settled_by is None and any(message[0] != "ok" for message in messages.values()):
            settled_by = time.monotonic() + SETTLE_SECONDS
    failure = _first_failure(children, messages, nproc)
    if failure is not None:
        raise failure
    return messages[0][1]


def _send(writer: Connection, message: tuple[Any, ...]) -> None:
    """``message`` as torch.save writes it. Not Connection.send: torch's reducers for it share a
    tensor's memory with the receiver, which fails once this process has exited."""
    import torch

    buffer = io.BytesIO()
    torch.save(message, buffer)
    writer.send_bytes(buffer.getbuffer())


def _receive(reader: Connection) -> tuple[Any, ...] | None:
    """The child's message if one is there, None if not (yet)."""
    import torch

    try:
        data = reader.recv_bytes() if reader.poll() else None
    except (EOFError, OSError):  # closed without a message: its exit code tells why
        return None
    # On the CPU: a CUDA tensor restored on its GPU would initialise CUDA here, and no later
    # spawn could fork. weights_only=False: any object fn returns, from this program's own child.
    return None if data is None else torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _first_failure(children: dict[int, BaseProcess], messages: dict[int, tuple[Any, ...]],
                   nproc: int) -> Exception | None:
    """The error of the failure that caused the others, or None if no rank failed.

    A rank that died without a word (killed, crashed, ``os._exit``) comes first: the ranks that
    raised meanwhile lost their peer. SIGABRT comes last, as that is how gloo and NCCL end a rank
    whose peer left. Among ranks that raised, the earliest by its time stamp: a rank stamps its
    failure before it leaves the group, so before its peers can notice.
    """
    silent, raised, aborted = [], [], []
    for rank, message in messages.items():
        if message[0] == "error":
            raised.append((message[3], rank))
        elif message[0] == "lost":
            (aborted if children[rank].exitcode == -signal.SIGABRT else silent).append((message[1], rank))
    for group in (silent, raised, aborted):
        if group:
            rank = min(group)[1]
            return _error(rank, children[rank].exitcode, messages[rank], nproc)
    return None


def _error(rank: int, exitcode: int | None, message: tuple[Any, ...], nproc: int) -> Exception:
    if message[0] == "error":
        _, summary, text, _, user_error = message
        if user_error is not None:
            return user_error  # init refused the options: the same message as in a script
        return SpawnError(f"rank {rank} of {nproc} raised {summary}; the other ranks were stopped.\n"
                          f"Its traceback:\n{text.rstrip()}", rank, exitcode, text)
    code = exitcode if exitcode is not None else 0
    return SpawnError(f"{describe_failure({rank: code})} before its function returned (of {nproc} ranks); "
                      "the other ranks were stopped", rank, code)


def _stop(children: dict[int, BaseProcess]) -> None:
    """SIGTERM to every child still running (its whole session), then SIGKILL after the grace period."""
    running = [child for child in children.values() if child.is_alive()]
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_SECONDS), (signal.SIGKILL, None)):
        for child in running:
            _signal(child, sig)
        deadline = time.monotonic() + (grace or 0.0)
        for child in running:
            child.join(None if grace is None else max(0.0, deadline - time.monotonic()))
        running = [child for child in running if child.is_alive()]
        if not running:
            return


def _signal(child: BaseProcess, sig: int) -> None:
    assert child.pid is not None
    try:
        os.killpg(child.pid, sig)
    except (ProcessLookupError, PermissionError):  # not yet its own session leader
        with suppress(ProcessLookupError):
            os.kill(child.pid, sig)
