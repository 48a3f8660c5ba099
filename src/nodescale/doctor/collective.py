"""The one part that needs a process group: a verified, timed all_reduce and rank 0's links.

Called on every rank only after rank 0 found nothing that would stop a process group. Every
wait is bounded by the timeout given to the process group, and every error is caught and
returned in the measurement: a collective that fails on one rank becomes a ``fail`` row on
rank 0's table, not a traceback.

The all_reduce follows nccl-tests: warm-up, then ``iters`` back-to-back operations between a
barrier and a device synchronisation, timed on each rank's own clock. Correctness is checked
before and after the timed loop: each rank contributes ``rank + 1`` in every element, so every
element of the sum must be exactly ``n (n + 1) / 2`` (exact in float32 up to n = 5792; larger
jobs use float64). The timed loop reduces zeros, whose cost is the same and which cannot
overflow however many iterations run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from nodescale.distributed.env import DistEnv

ALLREDUCE_BYTES = 4 * 2**20  # a few MB: past the latency-bound sizes, quick on any link
WARMUP = 2
ITERS = 5
LINK_ITERS = 3


def run(env: DistEnv, backend: str, timeout_s: float, partners: Sequence[int]) -> dict[str, Any]:
    """Start the process group, measure, leave it; the measurement, never an exception."""
    import torch

    from nodescale.distributed.process_group import abandon, shutdown, start

    result: dict[str, Any] = {"error": None, "backend": backend}
    runtime = None
    phase = "starting the process group"
    try:
        runtime = start(env, backend, timeout_s)
        device = runtime.device if backend == "nccl" else torch.device("cpu")
        phase = "all_reduce"
        result.update(_allreduce(env, device))
        phase = "link test"
        result["links"] = _links(env, device, partners)
        phase = "final check"
        _verify(env, device, result)
        phase = "shutting down the process group"
        shutdown(runtime)
    except Exception as exc:  # reported on rank 0's table; the other ranks time out the same way
        result["error"] = f"{phase} failed: {type(exc).__name__}: {_first_line(exc)}"
        if runtime is not None:
            try:
                abandon(runtime)  # no barrier: a peer may be gone
            except Exception:
                pass
    return result


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def _dtype(world_size: int) -> Any:
    import torch

    return torch.float32 if world_size * (world_size + 1) // 2 < 2**24 else torch.float64


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _verify(env: DistEnv, device: Any, result: dict[str, Any]) -> None:
    """One all_reduce of rank+1 everywhere, compared element by element with n(n+1)/2."""
    import torch
    import torch.distributed as dist

    dtype = _dtype(env.world_size)
    elements = ALLREDUCE_BYTES // torch.tensor([], dtype=dtype).element_size()
    tensor = torch.full((elements,), float(env.rank + 1), dtype=dtype, device=device)
    dist.all_reduce(tensor)
    _sync(device)
    expected = env.world_size * (env.world_size + 1) / 2
    wrong = tensor != expected
    count = int(wrong.sum().item())
    result["passes"] = result.get("passes", 0) + 1
    result["expected"] = expected
    result["elements"] = elements
    result["dtype"] = str(dtype).replace("torch.", "")
    if count:
        result["verified"] = False
        result["wrong"] = result.get("wrong", 0) + count
        result["got"] = float(tensor[wrong.nonzero()[0]].item())
    else:
        result.setdefault("verified", True)
        result.setdefault("wrong", 0)
        result.setdefault("got", expected)


def _allreduce(env: DistEnv, device: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    result: dict[str, Any] = {}
    _verify(env, device, result)  # also the first warm-up
    dtype = _dtype(env.world_size)
    element = torch.tensor([], dtype=dtype).element_size()
    buffer = torch.zeros(ALLREDUCE_BYTES // element, dtype=dtype, device=device)
    for _ in range(WARMUP - 1):
        dist.all_reduce(buffer)
    _sync(device)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(ITERS):
        dist.all_reduce(buffer)
    _sync(device)
    seconds = (time.perf_counter() - started) / ITERS
    result.update(bytes=buffer.numel() * element, iters=ITERS, seconds=seconds)
    return result


def _links(env: DistEnv, device: Any, partners: Sequence[int]) -> dict[str, float]:
    """Rank 0 sends to and receives from each partner in turn: seconds per round trip.

    One pair at a time, so nothing else shares the links; the other ranks wait in the final
    all_reduce meanwhile (bounded by the process group's timeout).
    """
    import torch
    import torch.distributed as dist

    buffer = torch.zeros(ALLREDUCE_BYTES // 4, dtype=torch.float32, device=device)
    links: dict[str, float] = {}
    for partner in partners:
        if env.rank not in (0, partner):
            continue
        peer = partner if env.rank == 0 else 0
        started = 0.0
        for step in range(1 + LINK_ITERS):  # the first round trip is a warm-up (connection set-up)
            if step == 1:
                _sync(device)
                started = time.perf_counter()
            if env.rank == 0:
                dist.send(buffer, peer)
                dist.recv(buffer, peer)
            else:
                dist.recv(buffer, peer)
                dist.send(buffer, peer)
        _sync(device)
        if env.rank == 0:
            links[str(partner)] = (time.perf_counter() - started) / LINK_ITERS
    return links
