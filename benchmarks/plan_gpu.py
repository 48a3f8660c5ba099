"""``nodescale plan`` against one GPU: ResNet-50 and ViT-B/16, estimate beside measurement.

For each model, ``nodescale train`` runs on the GPU at hand (synthetic 3x224x224 images, 1000
classes, bf16, AdamW, one process), and the plan's figures for that run's config
(``nodescale.plan.calibrate.estimate_run``: what ``nodescale report`` shows) are put beside its
summary.json: state bytes (parameters, gradients, optimiser state), the peak memory
(``torch.cuda.max_memory_allocated``) against state + activations, and the step time at the
default efficiency against the measured one (with the efficiency that would have matched it).

    bash scripts/gpu-check.sh plan                 # on the GPU machine: JSON in $OUT/plan-gpu.json
    python benchmarks/plan_gpu.py --out plan-gpu.json --batch-size 64 --steps 30

Without CUDA it computes the plan's side only (model measured without memory, no step time:
no device peak), writes it, and exits 2 saying so.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import HERE, child_env, machine, nodescale_summary, wide_console, write_results

MODELS = {"resnet50": ["--set", "model.stem=imagenet"], "vit_b16": ["--set", "model.patch_size=16"]}
DATA = ["--dataset", "synthetic", "--set", "data.image_size=224", "--set", "data.num_classes=1000"]
KINDS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "total_bytes")


def train(model: str, args: argparse.Namespace, run_dir: Path) -> None:
    argv = [sys.executable, "-m", "nodescale", "train", "--strategy", "single", "--model", model, *MODELS[model],
            *DATA, "--set", f"data.samples={args.batch_size * 4}", "--batch-size", str(args.batch_size),
            "--precision", "bf16", "--optimizer", "adamw", "--max-steps", str(args.steps), "--epochs", "100000",
            "--set", f"train.timing_warmup_steps={args.warmup_steps}", "--set", "checkpoint.at_end=false",
            "--no-progress", "--out", str(run_dir)]
    subprocess.run(argv, env=child_env(None), check=True)


def config_of(model: str, args: argparse.Namespace) -> Any:
    """The config ``train`` would write, for the plan's side alone (no run)."""
    from nodescale.config.load import load_config

    extra = dict(item.split("=", 1) for item in MODELS[model][1::2])
    return load_config(None, {"model.name": model, "data.name": "synthetic", "data.image_size": 224,
                              "data.num_classes": 1000, "data.samples": 8, "train.batch_size": args.batch_size,
                              "train.precision": "bf16", "optim.name": "adamw", **extra})


def compare(model: str, run_dir: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    from nodescale.config.load import load_config
    from nodescale.plan.calibrate import MeasuredRun, estimate_run
    from nodescale.plan.make import DEFAULT_EFFICIENCY

    summary = nodescale_summary(run_dir) if run_dir else {"world_size": 1}
    cfg = load_config(run_dir / "config.yaml") if run_dir else config_of(model, args)
    estimate = estimate_run(MeasuredRun(run_dir or Path("."), summary, cfg), DEFAULT_EFFICIENCY)
    measured_state = summary.get("state_bytes_per_rank") or {}
    planned_peak = estimate.state.total_bytes + estimate.activation_bytes + estimate.gathered_bytes
    step = estimate.step
    row: dict[str, Any] = {
        "model": model, "batch_size": args.batch_size, "device": summary.get("device"),
        "state": {kind: {"planned": getattr(estimate.state, kind), "measured": measured_state.get(kind)}
                  for kind in KINDS},
        "activation_bytes_planned": estimate.activation_bytes,
        "peak_memory": {"planned": planned_peak, "measured": summary.get("peak_memory_bytes"),
                        "kind": summary.get("peak_memory_kind")},
        "step_seconds": {"planned": step.total_s if step else None, "measured": summary.get("step_seconds"),
                         "efficiency": estimate.efficiency},
        "mfu": summary.get("mfu"),
    }
    if step and summary.get("step_seconds"):  # the efficiency at which the plan would have said the measured step
        row["step_seconds"]["efficiency_that_matches"] = step.compute_s * estimate.efficiency / summary["step_seconds"]
    return row


def show(rows: list[dict[str, Any]]) -> None:
    console = wide_console(120)
    for row in rows:
        console.print(f"[bold]{row['model']}[/bold] batch {row['batch_size']} on {row['device']}")
        for name, pair in (*row["state"].items(), ("peak memory", row["peak_memory"]),
                           ("step seconds", row["step_seconds"])):
            planned, measured = pair["planned"], pair["measured"]
            ratio = f"{planned / measured:.3f}" if planned and measured else "n/a"
            console.print(f"  {name:<16} planned {planned!s:>16}  measured {measured!s:>16}  planned/measured {ratio}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "plan_gpu.json")
    args = parser.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    rows = []
    with tempfile.TemporaryDirectory(prefix="nodescale-plan-gpu-") as tmp:
        for model in filter(None, args.models.split(",")):
            run_dir = Path(tmp) / model if cuda else None
            if run_dir is not None:
                train(model, args, run_dir)
            rows.append(compare(model, run_dir, args))
    show(rows)
    write_results(args.out, machine(), {"cuda": cuda, "settings": {k: str(v) for k, v in vars(args).items()},
                                        "results": rows}, wide_console(120))
    if not cuda:
        print("plan_gpu: no CUDA device here: only the plan's side was computed (nothing measured)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
