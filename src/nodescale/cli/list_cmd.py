"""``nodescale models`` and ``nodescale datasets``: what the registries hold."""

from __future__ import annotations

import argparse


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    subparsers.add_parser("models", help="list the built-in models").set_defaults(handler=list_models)
    subparsers.add_parser("datasets", help="list the dataset formats").set_defaults(handler=list_datasets)


def list_models(args: argparse.Namespace) -> int:
    from nodescale.models.registry import HF_MODEL, MODELS

    for name, entry in {**MODELS, "hf:DIR": HF_MODEL}.items():
        print(f"{name:<11} {entry.task:<17} {entry.description}")
    return 0


def list_datasets(args: argparse.Namespace) -> int:
    from nodescale.data.registry import DATASETS

    for name, entry in DATASETS.items():
        print(f"{name:<12} {entry.description}\n{'':<12} --data-dir: {entry.layout}")
    return 0
