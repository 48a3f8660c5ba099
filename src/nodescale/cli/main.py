"""``nodescale``: one subcommand per module; parse, call the library, print.

User mistakes (``UserError``) are printed without a traceback and exit 2.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from nodescale import __version__
from nodescale.cli import (
    bench_cmd,
    checkpoint_cmd,
    config_cmd,
    data_cmd,
    doctor_cmd,
    jobs_cmd,
    launch_cmd,
    list_cmd,
    logs_cmd,
    plan_cmd,
    report_cmd,
    train_cmd,
)
from nodescale.errors import EXIT_USER_ERROR, UserError, one_line_warning

# The `nodescale` script, not `python3 -m`: its shebang names the right interpreter, where Open MPI puts its
# own bin directory (/usr/bin on Debian, with another python3) first on the ranks' PATH.
SWEEP_MEMBER = "sweep-member"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodescale",
        description="Take a PyTorch training job from one GPU to many GPUs and many nodes.",
    )
    parser.add_argument("--version", action="version", version=f"nodescale {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train_cmd.add_parser(subparsers)
    config_cmd.add_parser(subparsers)
    data_cmd.add_parser(subparsers)
    launch_cmd.add_parser(subparsers)
    plan_cmd.add_parser(subparsers)
    checkpoint_cmd.add_parser(subparsers)
    doctor_cmd.add_parser(subparsers)
    bench_cmd.add_parser(subparsers)
    report_cmd.add_parser(subparsers)
    jobs_cmd.add_parsers(subparsers)
    list_cmd.add_parsers(subparsers)
    logs_cmd.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = one_line_warning  # type: ignore[assignment]
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == [SWEEP_MEMBER]:  # not a user's command: an array job's wrapper on every rank (no parser)
        from nodescale.launch.sweep_member import main as run_member

        return run_member(given[1:])
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: a sweep records launch's flags
    try:
        return args.handler(args)
    except UserError as exc:
        from nodescale.launch.schedulers.local_launcher import report_user_error

        report_user_error(exc)  # a worker of --nproc hands it to the launcher, which prints it once
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("nodescale: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
