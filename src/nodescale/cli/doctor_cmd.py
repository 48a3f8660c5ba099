"""``nodescale doctor``: a preflight check of a multi-node job, run on every rank.

On its own with ``--nproc N`` it starts N local processes, torchrun-style, and each one does
its rank's part; under torchrun, srun or mpiexec (``nodescale launch ... -- nodescale doctor``)
each process is a rank already. Rank 0 prints the table. Exit code 0 when no check failed,
1 when one did, 2 for a mistake on the command line.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path

from nodescale.errors import UserError, unknown_choice

BACKENDS = ("auto", "gloo", "nccl")
DEFAULT_TIMEOUT_S = 60.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="preflight check: ranks, launch arithmetic, versions, network, a timed all_reduce",
        description="Check what makes multi-node jobs hang, on every rank: the launch arithmetic, versions and "
        "devices across nodes, network interfaces and the rendezvous address, misspelt NCCL/FI variables, "
        "and a verified, timed all_reduce. Rank 0 prints a table (ok/warn/fail with hints). Exit code 0 when "
        "nothing failed, 1 when a check failed, 2 for a usage mistake.",
    )
    parser.add_argument("--nproc", metavar="N",
                        help="start N local processes (default 1; ignored under torchrun, srun or mpiexec)")
    parser.add_argument("--out", metavar="DIR", help="write DIR/doctor.json (all ranks' facts and the checks)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    parser.add_argument("--timeout", metavar="S", default=str(int(DEFAULT_TIMEOUT_S)),
                        help=f"seconds any rank waits for another at each step (default {int(DEFAULT_TIMEOUT_S)})")
    parser.add_argument("--backend", default="auto", help="auto (nccl on GPUs, else gloo), gloo or nccl")
    parser.set_defaults(handler=run)


def parse_nproc(text: str | None) -> int | None:
    """``--nproc``: a positive whole number, or None when not given."""
    if text is None:
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise UserError(f"--nproc {text}", "must be a whole number, at least 1", "e.g. --nproc 2")
    return int(text)


def parse_timeout(text: str) -> float:
    """``--timeout``: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"--timeout {text}", "must be a positive number of seconds", "e.g. --timeout 60")
    return value


def _out_dir(text: str | None) -> Path | None:
    """``--out``: a directory that exists or can be made, checked before any process starts."""
    if text is None:
        return None
    out = Path(text).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {text}", f"cannot be created ({exc.strerror or exc})",
                        "choose a directory you can write to") from exc
    return out


def run(args: argparse.Namespace) -> int:
    nproc = parse_nproc(args.nproc)
    timeout_s = parse_timeout(args.timeout)
    if args.backend not in BACKENDS:
        raise unknown_choice("--backend", args.backend, BACKENDS)
    out = _out_dir(args.out)
    # torch's C++ side logs every failed store connection with a stack trace; the doctor reports
    # those failures itself, in one line. Set before torch is imported (here and in --nproc's
    # workers, which inherit it); an explicit TORCH_CPP_LOG_LEVEL wins.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    from nodescale.distributed.env import detect

    env = detect()
    if env.source == "single" and nproc is not None and nproc > 1:
        return _launch_local(nproc, out, args.json, timeout_s, args.backend)
    if nproc is not None and env.source != "single" and env.rank == 0 and nproc != env.world_size:
        warnings.warn(f"--nproc ignored: {env.source} started {env.world_size} processes", stacklevel=1)
    from nodescale.doctor.runner import Options
    from nodescale.doctor.runner import run as run_doctor

    return run_doctor(env, Options(timeout_s=timeout_s, backend=args.backend, out=out, json=args.json))


def _launch_local(nproc: int, out: Path | None, as_json: bool, timeout_s: float, backend: str) -> int:
    """Run the doctor in ``nproc`` local processes; rank 0's verdict is the exit code."""
    from nodescale.doctor.facts import VERDICT_VARIABLE
    from nodescale.launch.schedulers.local_launcher import run_cli_locally

    argv = ["doctor", "--timeout", repr(timeout_s), "--backend", backend]
    argv += ["--out", str(out)] if out is not None else []
    argv += ["--json"] if as_json else []
    with tempfile.TemporaryDirectory(prefix="nodescale-doctor-") as handoff:
        verdict = Path(handoff) / "exit-code"
        os.environ[VERDICT_VARIABLE] = str(verdict)
        try:
            code = run_cli_locally(argv, nproc)
        finally:
            del os.environ[VERDICT_VARIABLE]
        if code != 0:
            return code
        if not verdict.exists():
            print("nodescale: error: doctor's rank 0 exited without a verdict", file=sys.stderr)
            return 1
        return int(verdict.read_text().strip())
