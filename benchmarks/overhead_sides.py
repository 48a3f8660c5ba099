"""``overhead.py``'s cases and sides: what each side runs for a case, and one run of it.

Every side of a case gets the same job in the same words: the same model, data, batch per
process, optimiser, steps, warm-up exclusion, process count and ``OMP_NUM_THREADS``. The
script sides (``raw``, ``library``, ``lightning``, ``accelerate``) take ``raw_ddp.py``'s flags
and print a ``RESULT`` line; ``nodescale`` is ``nodescale train`` and its ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from harness import HERE, child_env, nodescale_summary, result_line, run_logged

RAW_SCRIPT = HERE / "raw_ddp.py"  # the baseline: a hand-written DDP loop
RAW_LM_SCRIPT = HERE / "raw_lm.py"  # a language model's loop (token windows, loss over every next token)
SCRIPTS = {
    "raw": RAW_SCRIPT,
    "library": HERE / "library_ddp.py",  # raw_ddp.py's loop through nodescale.init/ctx calls
    "lightning": HERE / "lightning_loop.py",  # the same job as a Lightning Trainer script
    "accelerate": HERE / "accelerate_loop.py",  # raw_ddp.py's loop under Accelerate's wrapping
}
SIDES = ("raw", "nodescale", "library", "lightning", "accelerate")
UNBOUNDED_EPOCHS = 1_000_000


@dataclass(frozen=True)
class Case:
    """One benchmark configuration, run identically by every side."""

    name: str
    model: str
    dataset: str
    batch_size: int  # per process
    steps: int  # optimiser steps in total, warm-up included
    warmup_steps: int  # first steps excluded from the timing, on every side
    image_size: int | None = None  # synthetic data only
    channels: int | None = None  # synthetic data only
    samples: int | None = None  # synthetic data only
    seq_len: int | None = None  # language models: tokens per window (raw_lm.py's loop)
    optimizer: str | None = None  # None: every side's default, AdamW (lr 3e-3, weight decay 0)
    lr: float | None = None
    momentum: float | None = None  # SGD
    sides: tuple[str, ...] = SIDES  # the sides that run this case, raw (the baseline) first
    description: str = ""

    @property
    def timed_steps(self) -> int:
        return self.steps - self.warmup_steps


FRAMEWORKS = ("lightning", "accelerate")
CASES: dict[str, Case] = {
    # Small steps (~7 ms on one core): per-step Python overhead shows up here.
    "cnn-digits": Case(
        "cnn-digits", "cnn", "digits", batch_size=32, steps=1000, warmup_steps=5,
        description="2-block CNN, sklearn 8x8 digits, batch 32/process",
    ),
    # CSC's MNIST ConvNet example in shape: 1x28x28 images, batch 64/process, plain SGD at lr 0.01.
    # 60,000 images as MNIST's training set: 300 steps of 2 x 64 stay in the first epoch.
    "cnn-synthetic28": Case(
        "cnn-synthetic28", "cnn", "synthetic", batch_size=64, steps=300, warmup_steps=10,
        image_size=28, channels=1, samples=60_000, optimizer="sgd", lr=0.01, momentum=0.0,
        description="2-block CNN, random 1x28x28 images (MNIST's shape), batch 64/process, SGD lr 0.01",
    ),
    # Compute-bound steps (~0.8 s on one core): overhead should vanish here. The frameworks
    # are compared on the small steps only, where their cost per step can show.
    "resnet18-synthetic32": Case(
        "resnet18-synthetic32", "resnet18", "synthetic", batch_size=16, steps=15, warmup_steps=3,
        image_size=32, samples=2048, sides=("raw", "nodescale", "library"),
        description="ResNet-18 (CIFAR stem), random 3x32x32 images, batch 16/process",
    ),
    # nodescale train --model gpt_nano --dataset pydoc with its defaults (~0.4 s steps on one core);
    # 25 steps stay inside the first epoch (91 steps, whose end nodescale pauses to evaluate) and keep
    # 8 pairs near 10 minutes on 2 shared cores.
    "gpt-nano-pydoc": Case(
        "gpt-nano-pydoc", "gpt_nano", "pydoc", batch_size=32, steps=25, warmup_steps=5, seq_len=64,
        sides=("raw", "nodescale"),
        description="gpt_nano (0.82M, Llama flavour) on pydoc bytes, 64-token windows, batch 32/process",
    ),
}


@dataclass
class RunResult:
    """One training run of one side."""

    side: str  # one of SIDES
    case: str
    repeat: int
    step_seconds: float
    samples_per_second: float
    timed_steps: int
    timed_samples: int  # all ranks
    wall_seconds: float  # the whole subprocess: start-up, training, evaluation, shutdown
    tokens_per_second: float | None = None  # language models: all ranks' tokens over the timed steps
    losses: dict[str, float] | None = None  # language models: the loss logged at each log step, by step


# ---------------------------------------------------------------- commands
def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def script_command(side: str, case: Case, nproc: int) -> list[str]:
    """A script side of ``case``: torchrun and the script (Lightning starts its own processes from a plain
    ``python``, as its documentation does on one machine), then ``raw_ddp.py``'s flags for the job."""
    if case.seq_len is not None:  # raw_lm.py: a constant learning rate, no validation, always
        return [*torchrun(nproc), str(RAW_LM_SCRIPT), "--model", case.model, "--dataset", case.dataset,
                "--batch-size", str(case.batch_size), "--steps", str(case.steps),
                "--warmup-steps", str(case.warmup_steps), "--seq-len", str(case.seq_len)]
    launch = [sys.executable] if side == "lightning" else torchrun(nproc)
    cmd = [*launch, str(SCRIPTS[side]), *(["--nproc", str(nproc)] if side == "lightning" else []),
           "--model", case.model, "--dataset", case.dataset, "--batch-size", str(case.batch_size),
           "--steps", str(case.steps), "--warmup-steps", str(case.warmup_steps),
           "--schedule", "constant", "--no-validate"]  # nodescale: optim.schedule=constant, validation not timed
    for flag, value in (("--image-size", case.image_size), ("--channels", case.channels),
                        ("--samples", case.samples), ("--optimizer", case.optimizer), ("--lr", case.lr),
                        ("--momentum", case.momentum)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def nodescale_command(case: Case, nproc: int, run_dir: Path) -> list[str]:
    """``nodescale train`` of ``case``, stopping at its steps (also ``observe_overhead.py``'s job)."""
    cmd = [
        sys.executable, "-m", "nodescale", "train", "--nproc", str(nproc),
        "--model", case.model, "--dataset", case.dataset, "--batch-size", str(case.batch_size),
        # nodescale stops at whichever comes first, epochs (default 10) or max-steps; the raw
        # script knows only steps, so the epoch limit must never be the one that binds.
        "--max-steps", str(case.steps), "--epochs", str(UNBOUNDED_EPOCHS),
        "--out", str(run_dir), "--no-progress",
        "--set", "optim.schedule=constant",  # the raw script's learning rate is constant too
        "--set", f"train.timing_warmup_steps={case.warmup_steps}",
        # The final checkpoint is outside the timed region; skipping it only saves wall time.
        "--set", "checkpoint.at_end=false",
    ]
    for key, value in (("data.image_size", case.image_size), ("data.channels", case.channels),
                       ("data.samples", case.samples), ("optim.name", case.optimizer), ("optim.lr", case.lr),
                       ("optim.momentum", case.momentum)):
        if value is not None:
            cmd += ["--set", f"{key}={value}"]
    if case.seq_len is not None:
        cmd += ["--seq-len", str(case.seq_len)]
    return cmd


def logged_losses(run_dir: Path) -> dict[str, float]:
    """The loss of each ``step`` record in a nodescale run's metrics.jsonl, by step."""
    records = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip())
    return {str(r["step"]): r["loss"] for r in records if r.get("kind") == "step"}


def run_side(side: str, case: Case, repeat: int, args: argparse.Namespace, workdir: Path) -> RunResult:
    """One run of ``side`` on ``case``, its log (and nodescale's run directory) in ``workdir``."""
    name = f"{side}-{case.name}-{repeat}"
    log = workdir / f"{name}.log"
    if side == "nodescale":
        done = run_logged(nodescale_command(case, args.nproc, workdir / name), child_env(args.threads), log).check()
        data = nodescale_summary(workdir / name)
        if case.seq_len is not None:
            data["losses"] = logged_losses(workdir / name)
    else:
        done = run_logged(script_command(side, case, args.nproc), child_env(args.threads), log).check()
        data = result_line(log)
    return RunResult(side, case.name, repeat, data["step_seconds"], data["samples_per_second"], data["timed_steps"],
                     data["timed_samples"], done.wall_seconds, data.get("tokens_per_second"), data.get("losses"))
