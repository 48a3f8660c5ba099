"""``nodescale config show``: the resolved configuration as YAML."""

from __future__ import annotations

import argparse

from nodescale.cli.run_flags import add_run_flags, resolve_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("config", help="show the resolved configuration")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show", help="print the configuration that train would use, as YAML (feed it back with --config)"
    )
    add_run_flags(show)
    show.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from nodescale.config.load import dump_yaml

    print(dump_yaml(resolve_config(args)), end="")
    return 0
