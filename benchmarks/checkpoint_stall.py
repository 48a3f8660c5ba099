"""What a checkpoint costs the training loop: a save that waits against one in the background.

One job of 2 gloo ranks (``torchrun``, the library API) trains a wide MLP with AdamW, whose
state (weights plus two moments) takes over a second to write here, and measures in
interleaved pairs (the order alternates every pair):

* the stall per save: how long ``ctx.save_checkpoint`` keeps the ranks from training, waiting
  (``background=False``: gather, write, sync, hash, manifest) against in the background
  (``--checkpoint-async``: the copy to host memory only);
* the step time with no save in flight, against the step time while a background save is
  being written (the write competes for the CPU and memory bandwidth);
* how long the background write then took (from the save call to the end of the first step that
  finds the checkpoint whole: at a step's resolution).

Judged on minima, as on a shared machine noise only ever adds time.

    python benchmarks/checkpoint_stall.py                       # ddp, 8 pairs (~3 min on 2 cores)
    python benchmarks/checkpoint_stall.py --strategy fsdp --pairs 10

Results go to ``benchmarks/results/checkpoint_stall.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import HERE, PAIRS, child_env, machine, result_line, run_logged, wide_console, write_results  # noqa: E402

DEFAULT_OUT = HERE / "results" / "checkpoint_stall.json"


def worker(args: argparse.Namespace) -> None:
    """One rank: the pairs, timed; rank 0 prints the figures as a RESULT line."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import nodescale

    ctx = nodescale.init(strategy=args.strategy, seed=0, out=args.dir, keep_last=2)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(args.width, 8))
    parameters = sum(p.numel() for p in model.parameters())
    model, optimizer = ctx.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    state = {"model": model, "optimizer": optimizer}
    x, y = torch.randn(args.batch, args.width), torch.randint(0, 8, (args.batch,))

    def step() -> float:
        started = time.perf_counter()
        ctx.backward(F.cross_entropy(model(x), y))
        ctx.step(optimizer)
        ctx.barrier()  # every rank's step over: the time of the slower rank, as DDP's all-reduce makes it
        return time.perf_counter() - started

    for _ in range(3):  # warm-up: allocator, AdamW's state, the first checkpoint's directories
        step()
    pairs = []
    for pair in range(args.pairs):
        figures: dict[str, Any] = {"plain_steps": [step() for _ in range(args.steps)]}
        for side in (("sync", "async") if pair % 2 == 0 else ("async", "sync")):
            ctx.barrier()
            started = time.perf_counter()
            ctx.save_checkpoint(state, background=side == "async")
            figures[f"{side}_stall"] = time.perf_counter() - started
            if side == "async":  # train on while it is written; a step counts if the write was still going at its end
                during = []
                for _ in range(args.steps_during):
                    seconds = step()
                    if not ctx.sum(float(ctx.saves.in_flight)):  # every rank's write done: all leave together
                        break
                    during.append(seconds)
                ctx.saves.wait()
                figures["during_steps"] = during
                figures["async_write"] = time.perf_counter() - started  # to the first step end that saw it whole
        pairs.append(figures)
    if ctx.is_main:
        size = sum(p.stat().st_size for p in Path(args.dir, "checkpoints").rglob("*") if p.is_file()) / 2
        print("RESULT " + json.dumps({"parameters": parameters, "checkpoint_bytes": size, "pairs": pairs}), flush=True)
    ctx.close(summary=False)


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    pairs = result["pairs"]
    plain = [s for p in pairs for s in p["plain_steps"]]
    during = [s for p in pairs for s in p["during_steps"]]
    sync, stall = [p["sync_stall"] for p in pairs], [p["async_stall"] for p in pairs]
    writes = [p["async_write"] for p in pairs]
    figures = {
        "step_s_no_save": {"min": min(plain), "median": statistics.median(plain)},
        "step_s_during_save": {"min": min(during), "median": statistics.median(during)} if during else None,
        "steps_during_save": len(during),
        "stall_s_sync": {"min": min(sync), "median": statistics.median(sync)},
        "stall_s_async": {"min": min(stall), "median": statistics.median(stall)},
        "async_write_s": {"min": min(writes), "median": statistics.median(writes)},
    }
    figures["stall_ratio_async_to_sync_min"] = figures["stall_s_async"]["min"] / figures["stall_s_sync"]["min"]
    if during:
        figures["step_ratio_during_to_no_save_min"] = min(during) / min(plain)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--pairs", type=int, default=PAIRS, help="sync/async pairs (default %(default)s)")
    parser.add_argument("--width", type=int, default=2048, help="MLP width (default %(default)s)")
    parser.add_argument("--layers", type=int, default=10, help="hidden layers (default %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and step (default %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="steps timed with no save, per pair")
    parser.add_argument("--steps-during", type=int, default=12, help="steps taken after each background save")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    parser.add_argument("--dir", help="the run directory (default: a temporary one on /tmp's file system)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    console = wide_console(120)
    with tempfile.TemporaryDirectory(prefix="checkpoint-stall-") as scratch:
        run_dir = args.dir or str(Path(scratch) / "run")
        forwarded = ["--strategy", args.strategy, "--pairs", str(args.pairs), "--width", str(args.width),
                     "--layers", str(args.layers), "--batch", str(args.batch), "--steps", str(args.steps),
                     "--steps-during", str(args.steps_during), "--dir", run_dir]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(Path(__file__).resolve()), "--worker", *forwarded]
        log = Path(scratch) / "worker.log"
        finished = run_logged(cmd, child_env(args.threads), log, timeout=3600)
        if finished.code != 0:
            sys.exit(f"the benchmark job failed ({finished.code}):\n{log.read_text()[-4000:]}")
        result = result_line(log)
    figures = summarise(result)
    console.print(f"{args.strategy}, 2 gloo ranks, {result['parameters'] / 1e6:.1f} M parameters, "
                  f"checkpoint {result['checkpoint_bytes'] / 1e6:.0f} MB, {args.pairs} pairs")
    for name, value in figures.items():
        console.print(f"  {name}: {value}")
    write_results(args.out, machine("torch"), {"strategy": args.strategy, "figures": figures, **result}, console)


if __name__ == "__main__":
    main()
