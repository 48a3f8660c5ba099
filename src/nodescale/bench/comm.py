"""``bench comm`` on every rank: time each collective at each size, check its result, gather the rows.

Timing follows nccl-tests with one difference: warm-up calls, then a barrier and a device
synchronisation, then ``iters`` calls between two host clock readings, the second one after the
device has finished (:func:`nodescale.engine.device.synchronize`). The time of one operation is the
elapsed time divided by ``iters``; the reported time is the largest over the ranks (an all_reduce
MAX), since a collective is as slow as its slowest rank. (nccl-tests reports the average over
ranks unless run with ``-a 3``.) After timing, the buffers are filled again and one call is
checked element by element on every rank; ``wrong`` is the total of wrong elements over ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from nodescale.bench import comm_math
from nodescale.bench.comm_math import Settings
from nodescale.bench.comm_ops import DTYPES, ROOT, Case, Group
from nodescale.distributed.process_group import Runtime
from nodescale.engine.device import synchronize


def bench_device(runtime: Runtime) -> torch.device:
    """Where the buffers live: the GPU for NCCL; host memory for gloo, whose CPU path is the one every op has."""
    return runtime.device if runtime.backend == "nccl" else torch.device("cpu")


def make_group(runtime: Runtime, dtype: str, group: dist.ProcessGroup | None = None,
               ranks: tuple[int, ...] | None = None) -> Group:
    """The :class:`Group` of the whole job (``group`` None) or of ``ranks`` (a subgroup this rank belongs to)."""
    members = ranks if ranks is not None else tuple(range(runtime.world_size))
    modulus, exact = comm_math.fill_modulus(dtype, len(members))
    return Group(group, members.index(runtime.rank), members, bench_device(runtime), DTYPES[dtype], modulus, exact)


def group_barrier(group: Group) -> None:
    """Every rank of ``group`` waits for the others (NCCL needs to know the device it syncs)."""
    if group.device.type == "cuda":
        dist.barrier(group=group.group, device_ids=[group.device.index])
    else:
        dist.barrier(group=group.group)


def _reduce(group: Group, value: float, op: dist.ReduceOp.RedOpType, dtype: torch.dtype) -> float:
    tensor = torch.tensor([value], dtype=dtype, device=group.device)
    dist.all_reduce(tensor, op=op, group=group.group)
    return tensor.item()


def time_case(case: Case, warmup: int, iters: int) -> float:
    """Seconds per operation of ``case``: the mean of ``iters`` calls after ``warmup``, the slowest rank's."""
    g = case.g
    for _ in range(warmup):
        case.run()
    group_barrier(g)
    synchronize(g.device)
    start = time.perf_counter()
    for _ in range(iters):
        case.run()
    synchronize(g.device)
    seconds = (time.perf_counter() - start) / iters
    return _reduce(g, seconds, dist.ReduceOp.MAX, torch.float64)


def check_case(case: Case) -> int:
    """Wrong elements of one freshly filled call of ``case``, summed over the group's ranks."""
    case.reset()
    case.run()
    synchronize(case.g.device)
    return int(_reduce(case.g, float(case.wrong()), dist.ReduceOp.SUM, torch.float64))


def measure(op: str, counts: comm_math.Counts, in_place: bool, group: Group, settings: Settings) -> dict[str, Any]:
    """One result row: time (slowest rank), algbw, busbw and the check of ``op`` at ``counts``."""
    case = Case(op, counts, in_place, group)
    seconds = time_case(case, settings.warmup, settings.iters)
    wrong = check_case(case)
    del case  # free the buffers before the next size
    n = group.size
    return {
        "op": op,
        "bytes": counts.bytes,
        "requested_bytes": counts.requested_bytes,
        "count": counts.count,
        "dtype": settings.dtype,
        "redop": "sum" if op in comm_math.REDUCTIONS else None,
        "root": ROOT if op == "broadcast" else None,
        "in_place": in_place,
        "time_us": seconds * 1e6,
        "algbw_GBps": comm_math.algbw_gbps(counts.bytes, seconds),
        "busbw_GBps": comm_math.busbw_gbps(op, counts.bytes, seconds, n),
        "busbw_factor": comm_math.bus_factor(op, n),
        "wrong": wrong,
        "correct": wrong == 0,
        "world_size": n,
        "iterations": settings.iters,
        "warmup": settings.warmup,
    }


def skipped_reason(op: str, counts: comm_math.Counts, world_size: int) -> str | None:
    """Why ``op`` cannot run at ``counts`` on ``world_size`` ranks, or None when it can."""
    if op == "sendrecv" and world_size < 2:
        return "sendrecv needs 2 ranks (a rank does not send to itself)"
    if counts.count == 0:
        unit = "per rank, in whole 16-byte lines" if op in comm_math.PER_RANK_OPS else ""
        return f"the size holds no element {unit}".rstrip()
    return None


def run_sweep(runtime: Runtime, settings: Settings,
              on_op_done: Callable[[str, list[dict[str, Any]]], None] | None = None,
              on_skip: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every op of ``settings`` at every size, out of place then in place: the rows, identical on every rank.

    ``on_op_done(op, rows)`` is called after each op (rank 0 prints its table there); ``on_skip``
    receives a note for each op/size that cannot run.
    """
    group = make_group(runtime, settings.dtype)
    element = comm_math.DTYPE_BYTES[settings.dtype]
    rows: list[dict[str, Any]] = []
    for op in settings.ops:
        op_rows: list[dict[str, Any]] = []
        skipped: dict[str, list[int]] = {}  # reason -> sizes, one note per reason
        for size in settings.sizes:
            counts = comm_math.op_counts(op, size, element, group.size)
            reason = skipped_reason(op, counts, group.size)
            if reason:
                skipped.setdefault(reason, []).append(size)
                continue
            for in_place in (False, True) if op in comm_math.IN_PLACE_OPS else (False,):
                row = measure(op, counts, in_place, group, settings)
                row.update(backend=runtime.backend, device=str(group.device))
                op_rows.append(row)
        for reason, sizes in skipped.items():
            if on_skip:
                on_skip(f"{op} skipped at {', '.join(map(str, sizes))} B: {reason}")
        rows.extend(op_rows)
        if on_op_done and op_rows:
            on_op_done(op, op_rows)
    return rows
