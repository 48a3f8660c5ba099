"""``nodescale data pack`` and ``nodescale data inspect``: make tar shards of a dataset, and summarise one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser("data", help="make tar shards of a dataset (pack), summarise one (inspect)")
    commands = data.add_subparsers(dest="data_command", required=True, metavar="{pack,inspect}")
    pack = commands.add_parser("pack", help="turn an image folder, MNIST, CIFAR-10 or HDF5 into tar shards with a "
                               "manifest; in a cluster job each task packs its part")
    pack.add_argument("src", type=Path, help="the dataset: an image folder, MNIST or CIFAR-10 directory, .h5 file")
    pack.add_argument("--out", type=Path, required=True, help="directory of the shards and manifest.json")
    pack.add_argument("--shard-size", default="1GB", help="bytes per shard at most, e.g. 1GB, 256MiB (default 1GB)")
    pack.add_argument("--format", dest="source_format", choices=("imagefolder", "mnist", "cifar10", "hdf5"),
                      help="the source's format (default: detected from its files)")
    pack.add_argument("--workers", type=int, help="writer processes per task (default: the cores of its binding)")
    pack.set_defaults(handler=run_pack)
    inspect = commands.add_parser("inspect", help="summarise a dataset: format, samples, classes, shards, sizes")
    inspect.add_argument("location", help="a directory, file, or glob or brace list of shards")
    inspect.add_argument("--dataset", help="its format (default: detected from its files)")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")
    inspect.set_defaults(handler=run_inspect)


def run_pack(args: argparse.Namespace) -> int:
    from nodescale.data.pack import pack, parse_size
    from nodescale.errors import UserError

    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers {args.workers}", "must be at least 1", "pass --workers N with N >= 1")
    manifest = pack(args.src, args.out, parse_size(args.shard_size), args.source_format, args.workers)
    if manifest is None:
        print(f"nodescale: packed this task's shards into {args.out}; another task writes the manifest")
        return 0
    for split, part in manifest["splits"].items():
        print(f"{split}: {part['samples']} samples in {len(part['shards'])} shards")
    print(f"nodescale: wrote {args.out / 'manifest.json'}")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from nodescale.data.inspect import render, summarise

    summary = summarise(args.location, args.dataset)
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    return 0
