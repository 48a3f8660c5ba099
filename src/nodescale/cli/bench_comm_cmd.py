"""``nodescale bench comm``: nccl-tests' collective benchmarks in Python, on every rank of a job.

Started on its own, it checks its flags and starts ``--nproc`` local processes that run the same
command; started by torchrun, srun or mpiexec, each process does its rank's part. Rank 0 prints
the tables and writes ``results.json``, ``results.csv`` and ``busbw.png`` (or ``pairs.json``
with ``--pairs``) under ``--out``. Exit status 1 when any result was wrong.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from nodescale.bench import comm_math
from nodescale.bench.comm_math import Settings
from nodescale.errors import UserError, unknown_choice

if TYPE_CHECKING:
    from nodescale.distributed.env import DistEnv

DEFAULT_SIZES = "1K:64M"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "comm", help="bandwidth of all_reduce, all_gather, ... like nccl-tests (algbw, busbw, checked results)",
        description="Time collectives at a range of sizes like nccl-tests: warm-up excluded, synchronised on the "
        "device, the slowest rank's time; algbw = size/time and busbw = algbw x nccl-tests' factor, in GB/s "
        "(1e9 bytes/s); every result checked. Runs unchanged under torchrun, srun or mpiexec; on its own, "
        "--nproc starts the local processes.",
    )
    parser.add_argument("--nproc", default="auto", metavar="N",
                        help="local processes when not started by a launcher (default auto: one per GPU, 2 on CPU)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, metavar="START:END",
                        help=f"message sizes in bytes, K/M/G = 1024/1024^2/1024^3: START:END doubles from START "
                        f"(nccl-tests -b START -e END -f 2), or one SIZE (default {DEFAULT_SIZES})")
    parser.add_argument("--ops", default="all", metavar="OP[,OP...]",
                        help=f"operations to run (default all): {', '.join(comm_math.OPS)}")
    parser.add_argument("--dtype", default="float32", metavar="TYPE",
                        help=f"element type: {', '.join(comm_math.DTYPE_BYTES)} (default float32)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before each timing (default 5)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per size (default 20)")
    parser.add_argument("--backend", default="auto", metavar="NAME",
                        help="auto (nccl on GPUs, gloo on CPU), gloo or nccl")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="where results go (default ./bench-comm-YYYYMMDD-HHMMSS)")
    parser.add_argument("--pairs", action="store_true",
                        help="instead of the sweep: send/recv between every pair of nodes (ranks, on one node) "
                        "at the largest size, flagging pairs below 0.5 x the median")
    parser.add_argument("--no-plot", action="store_true", help="do not draw busbw.png")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="how long a rank waits for the others in any one call (default 600)")
    parser.set_defaults(handler=run)


def settings_from(args: argparse.Namespace) -> Settings:
    """Check every flag that needs no process; the :class:`~nodescale.bench.comm_math.Settings` they describe."""
    sizes = comm_math.parse_sizes(args.sizes)
    ops = comm_math.parse_ops(args.ops)
    dtype = comm_math.check_dtype(args.dtype)
    if args.warmup < 0:
        raise UserError(f"--warmup {args.warmup}", "must be 0 or more")
    if args.iters < 1:
        raise UserError(f"--iters {args.iters}", "must be at least 1")
    if args.backend not in ("auto", "gloo", "nccl"):
        raise unknown_choice("backend", args.backend, ("auto", "gloo", "nccl"))
    if args.timeout <= 0:
        raise UserError(f"--timeout {args.timeout}", "must be positive")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {str(args.out)!r}", "is a file, not a directory", "give a directory for the results")
    return Settings(tuple(ops), tuple(sizes), dtype, args.warmup, args.iters)


def _check_backend(backend: str) -> None:
    from nodescale.distributed.accelerators import visible_gpus  # torch only where a GPU driver is loaded

    if backend == "nccl" and not visible_gpus():
        raise UserError("--backend nccl", "needs CUDA GPUs, and this process sees none", "use --backend gloo on CPU")


def _nproc(value: str) -> int:
    if value == "auto":
        from nodescale.distributed.accelerators import default_local_processes

        return default_local_processes()
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"--nproc {value!r}", "must be a whole number of processes, at least 1, or auto")
    return int(value)


def run(args: argparse.Namespace) -> int:
    if args.nproc != "auto":
        _nproc(args.nproc)  # a typo in --nproc is reported before torch is imported
    settings = settings_from(args)
    _check_backend(args.backend)
    from nodescale.distributed.env import detect

    env = detect()
    if env.source != "single":  # started by torchrun, srun, mpiexec...: we are one of the ranks
        if args.nproc != "auto" and env.rank == 0:
            warnings.warn(f"--nproc ignored: {env.source} started {env.world_size} processes", stacklevel=1)
        return run_rank(args, settings, env)
    nproc = _nproc(args.nproc)
    if args.pairs and nproc < 2:
        raise UserError("--pairs", "needs at least 2 processes", "use --nproc 2 or more")
    args.out = args.out or default_out_dir()  # decided once, here, so every rank writes to the same place
    if nproc == 1:
        return run_rank(args, settings, env)
    from nodescale.launch.schedulers.local_launcher import run_cli_locally

    return run_cli_locally(worker_argv(args), nproc)


def default_out_dir() -> Path:
    """``./bench-comm-YYYYMMDD-HHMMSS``: a new directory per run, so results never overwrite each other."""
    return Path(f"bench-comm-{time.strftime('%Y%m%d-%H%M%S')}")


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The command each local process runs: this one, with every setting explicit and without --nproc."""
    argv = ["bench", "comm", "--sizes", args.sizes, "--ops", args.ops, "--dtype", args.dtype,
            "--warmup", str(args.warmup), "--iters", str(args.iters), "--backend", args.backend,
            "--out", str(args.out), "--timeout", str(args.timeout)]
    if args.pairs:
        argv.append("--pairs")
    if args.no_plot:
        argv.append("--no-plot")
    return argv


def run_rank(args: argparse.Namespace, settings: Settings, env: DistEnv) -> int:
    """This rank's part: join the group, run the sweep (or the pairs), rank 0 reports. 1 if anything was wrong."""

    from nodescale.bench import comm_worker
    from nodescale.distributed.process_group import shutdown, start

    if args.pairs and env.world_size < 2:
        raise UserError("--pairs", f"needs at least 2 ranks, and this job has {env.world_size}")
    runtime = start(env, args.backend, timeout_s=args.timeout)
    try:
        out = Path(args.out) if args.out else default_out_dir()
        if args.pairs:
            ok = comm_worker.pairs(runtime, settings, out)
        else:
            ok = comm_worker.sweep(runtime, settings, out, plot=not args.no_plot)
    finally:  # a script that set up its own group and calls the CLI in-process keeps it
        shutdown(runtime)
    return 0 if ok else 1
