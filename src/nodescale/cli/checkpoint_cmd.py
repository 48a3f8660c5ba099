"""``nodescale checkpoint export|info``: one plain state dict out of any run's checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "checkpoint", help="export or inspect a run's checkpoint",
        description="Work with checkpoints written by nodescale train (full files, FSDP's sharded directories, "
        "DeepSpeed's). No process group is needed.",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    export = actions.add_parser(
        "export", help="write the model's whole state dict to one file, or a Hugging Face directory",
        description="Consolidate a checkpoint (the newest of a run directory, or the one named) into one "
        "torch.save file that `model.load_state_dict(torch.load(FILE))` accepts on any machine, or (--format hf) "
        "into a directory that transformers' AutoModelForCausalLM.from_pretrained(DIR) loads.",
    )
    export.add_argument("path", type=Path, metavar="RUN_DIR|CHECKPOINT")
    export.add_argument("--out", type=Path, required=True, metavar="FILE|DIR",
                        help="where to write the state dict (--format pt) or the new directory (--format hf)")
    export.add_argument("--format", choices=("pt", "hf"), default="pt",
                        help="pt: one torch.save file of the state dict (default); hf: config.json + "
                        "model.safetensors, for hf:DIR models (and built-ins with a Hugging Face twin)")
    _add_trust_flag(export)
    export.set_defaults(handler=run_export)
    info = actions.add_parser("info", help="show what a checkpoint holds")
    info.add_argument("path", type=Path, metavar="RUN_DIR|CHECKPOINT")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_trust_flag(info)
    info.set_defaults(handler=run_info)


def _add_trust_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="load sharded files with their libraries' own loaders, which may run code a file holds "
                        "(by default only tensors and plain data are loaded, and anything else is refused)")


def run_export(args: argparse.Namespace) -> int:
    import torch

    from nodescale.atomic_files import write_atomic
    from nodescale.train.export import consolidated_model_state, resolve

    source = resolve(args.path)
    if args.format == "hf":
        from nodescale.train.hf_export import export_hf

        model = export_hf(source, args.out, args.trust_checkpoint)
        values = sum(parameter.numel() for parameter in model.parameters())
        print(f"nodescale: wrote {type(model).__name__} ({values:,} parameters) from {source} to {args.out}/")
        return 0
    state = consolidated_model_state(source, args.trust_checkpoint)
    if args.out.parent != Path():
        args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, lambda handle: torch.save(state, handle))
    values = sum(tensor.numel() for tensor in state.values())
    print(f"nodescale: wrote {len(state)} tensors ({values:,} values) from {source} to {args.out}")
    return 0


def run_info(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from nodescale.train.export import describe, integrity, resolve

    path = resolve(args.path, verified=False)  # a damaged checkpoint is worth inspecting too
    info = {**describe(path, args.trust_checkpoint), "integrity": integrity(path)}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    table = Table(title=f"checkpoint {info['path']}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in info.items():
        if key != "path":
            table.add_row(key.replace("_", " "), ", ".join(value) if isinstance(value, list) else str(value))
    Console().print(table)
    return 0
