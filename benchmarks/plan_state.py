"""``nodescale plan``'s state bytes against what real runs hold, for every built-in model and strategy.

For each model and each strategy of ``memory.py`` (DDP, FSDP full and grad-op, ZeRO 1-3, ZeRO-3
with every parameter sharded), runs ``nodescale train --nproc N`` for two steps and compares the
``state_bytes_per_rank`` of its summary.json (parameters, gradients, optimiser state of the largest
rank) with the plan's estimate from the run's config.yaml alone (the arithmetic of
``nodescale.plan.state_bytes`` over the shapes measured on the meta device). The target is
estimate/measured within 2% for every kind. tests/test_plan_state_bytes.py checks cnn and vit_tiny
in CI; this is the whole table.

    python benchmarks/plan_state.py                           # every built-in model but llama_1b (~25 min)
    python benchmarks/plan_state.py --models cnn,vit_tiny,gpt_nano --strategies ddp,zero-3

Image models train on 3x32x32 synthetic images, language models on pydoc windows of 32 tokens,
AdamW, fp32, batch 4 per process. llama_1b needs about 60 GB of host memory under DDP on 2 ranks
(name it with --models to include it). Results go to ``benchmarks/results/plan_state.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import HERE, child_env, machine, nodescale_summary, run_logged, wide_console, write_results
from memory import STRATEGIES, Strategy
from rich.table import Table

DEFAULT_OUT = HERE / "results" / "plan_state.json"
SKIPPED_BY_DEFAULT = ("toy", "llama_1b")  # toy: no blocks, nothing new; llama_1b: too large for most hosts
USED = ("ddp", "fsdp-full", "fsdp-grad-op", "zero-1", "zero-2", "zero-3", "zero-3-t0")
KINDS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "total_bytes")
TOLERANCE = 0.02


def train_command(model: str, strategy: Strategy, args: argparse.Namespace, run_dir: Path,
                  ds_config: Path | None) -> list[str]:
    from nodescale.models.registry import MODELS

    language = MODELS[model].task == "language_modeling"
    data = (["--dataset", "pydoc", "--seq-len", "32"] if language
            else ["--dataset", "synthetic", "--set", "data.image_size=32", "--set", "data.samples=64"])
    cmd = [sys.executable, "-m", "nodescale", "train", "--nproc", str(args.nproc), "--model", model, *data,
           "--optimizer", "adamw", "--batch-size", "4", "--max-steps", "2", "--no-progress", "--out", str(run_dir),
           "--set", "checkpoint.at_end=false", *strategy.flags]
    return cmd + (["--deepspeed-config", str(ds_config)] if ds_config is not None else [])


def run_one(model: str, strategy: Strategy, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import json

    label = f"{model}-{strategy.name}"
    run_dir = workdir / label
    ds_config = None
    if strategy.deepspeed_config is not None:
        ds_config = workdir / f"{strategy.name}.ds_config.json"
        ds_config.write_text(json.dumps(strategy.deepspeed_config))
    run_logged(train_command(model, strategy, args, run_dir, ds_config), child_env(1), workdir / f"{label}.log").check()
    measured = nodescale_summary(run_dir)["state_bytes_per_rank"]
    from nodescale.config.load import load_config
    from nodescale.plan.make import planned_state

    estimated = planned_state(load_config(run_dir / "config.yaml"), args.nproc).as_dict()
    ratios = {kind: estimated[kind] / measured[kind] if measured[kind] else 1.0 for kind in KINDS}
    return {"model": model, "strategy": strategy.name, "measured": {k: measured[k] for k in KINDS},
            "estimated": {k: estimated[k] for k in KINDS}, "ratio": ratios,
            "within": all(abs(r - 1) <= TOLERANCE for r in ratios.values())}


def results_table(rows: list[dict[str, Any]], nproc: int) -> Table:
    table = Table(title=f"plan estimate / measured state bytes per rank, {nproc} ranks, AdamW, fp32 (MB = 1e6 B)",
                  title_justify="left")
    for header in ("model", "strategy", "measured MB", "estimated MB", "params", "grads", "optim", "within 2%"):
        table.add_column(header, justify="left" if header in ("model", "strategy") else "right")
    for row in rows:
        table.add_row(row["model"], row["strategy"], f"{row['measured']['total_bytes'] / 1e6:.2f}",
                      f"{row['estimated']['total_bytes'] / 1e6:.2f}",
                      *(f"{row['ratio'][kind]:.4f}" for kind in KINDS[:3]), "yes" if row["within"] else "NO")
    return table


def main(argv: list[str] | None = None) -> int:
    from nodescale.models.registry import MODELS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(m for m in MODELS if m not in SKIPPED_BY_DEFAULT))
    parser.add_argument("--strategies", default=",".join(USED), help=f"of: {', '.join(USED)}")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    console = wide_console(120)
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="nodescale-plan-state-") as tmp:
        for model in filter(None, args.models.split(",")):
            for name in filter(None, args.strategies.split(",")):
                row = run_one(model, STRATEGIES[name], args, Path(tmp))
                rows.append(row)
                console.print(f"{model:<12} {name:<13} estimate/measured {row['ratio']['total_bytes']:.4f}")
    console.print(results_table(rows, args.nproc))
    write_results(args.out, machine("deepspeed"), {"nproc": args.nproc, "tolerance": TOLERANCE, "results": rows,
                                                   "total_seconds": time.perf_counter() - started}, console)
    return 0 if all(row["within"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
