"""nodescale's training-loop overhead against a hand-written DDP script and its peers, like for like.

Runs, in one invocation, repeated and interleaved runs of up to five sides per case:

* ``raw``: the case's hand-written script under ``python -m torch.distributed.run --standalone``
  (``raw_ddp.py`` for the image cases, ``raw_lm.py`` for the language model): the baseline;
* ``nodescale``: ``nodescale train --nproc N ... --set optim.schedule=constant``;
* ``library``: ``library_ddp.py``, raw_ddp.py's loop through ``nodescale.init`` and ``ctx`` calls;
* ``lightning``: ``lightning_loop.py``, the same job as a Lightning ``Trainer`` script (DDP);
* ``accelerate``: ``accelerate_loop.py``, raw_ddp.py's loop under Accelerate's wrapping;

with the same model, data, per-process batch size, optimiser, number of steps, warm-up
exclusion, process count and ``OMP_NUM_THREADS`` (the sides' modules name what differs). Each
side times its steady state between barriers after the warm-up and after the last step and
counts the samples of every rank (nodescale: ``step_seconds`` of its ``summary.json``). Every
non-raw side is compared with raw; the judged figure is the ratio of the minima of step time,
the median paired ratio beside it (``overhead_report.py``): nodescale <= 1.02, the library face
<= 1.01; Lightning and Accelerate are reported, and nodescale's best step must beat theirs on
the CNN cases. The language-model case (``gpt-nano-pydoc``, raw and nodescale only) is judged
on tokens/s, nodescale/raw >= 0.98 on the best runs, and checks that both logged the same losses.

Within each repeat the sides of a case run back to back, their order rotated one place per
repeat, so that a slow drift of the shared machine's load favours no side.

    python benchmarks/overhead.py                      # the CNN cases, all five sides, 8 repeats
    python benchmarks/overhead.py --cases all          # and ResNet-18 (raw, nodescale, library) and the LM
    python benchmarks/overhead.py --cases cnn-digits,cnn-synthetic28 --repeats 1 --steps 30    # a smoke run
    python benchmarks/overhead.py --cases cnn-digits --sides raw,library
    python benchmarks/overhead.py --cases gpt-nano-pydoc --out benchmarks/results/overhead-lm.json

Time. The default (cnn-digits and cnn-synthetic28, 5 sides, 8 repeats: 80 runs) takes about
30 minutes on 2 quiet cores and 55 on busy ones. Measured: one repeat of both cases at their
default steps took 399 s at a load average of 4-7 (a Lightning run 64 s, ~25-40 s of it start-up;
the other runs 20-49 s), x 8 = 53 minutes; there the raw loop's cnn-digits steps and start-up
took 1.65x and ~2x what they take on quiet cores (11.9 against 7.2 ms, 14 against 6.5 s in
``results/overhead.json``), hence about half that quiet. ``--cases all`` adds resnet18-synthetic32
(3 sides at ~20 s a run quiet: ~8 minutes) and gpt-nano-pydoc (~5 minutes quiet, ~9 busy):
~43 minutes quiet, over an hour on busy cores.
Results go to ``benchmarks/results/overhead.json`` (``--out`` to change), every run's figures
included.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import HERE, PAIRS, machine, rotated, wide_console, write_results  # noqa: E402
from overhead_report import TARGETS, ahead_lines, results_table, summarise, tokens_table  # noqa: E402
from overhead_sides import CASES, SIDES, RunResult, run_side  # noqa: E402

DEFAULT_OUT = HERE / "results" / "overhead.json"
# The small-step cases, where a per-step cost and the frameworks show: the default fits an hour on busy cores.
DEFAULT_CASES = ("cnn-digits", "cnn-synthetic28")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=PAIRS, help=f"runs of each side per case (default {PAIRS})")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimiser steps per run, warm-up included, for every case "
                             "(default: per case, " + ", ".join(f"{c.name} {c.steps}" for c in CASES.values()) + ")")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma-separated, of: {', '.join(CASES)}; or all (default: {','.join(DEFAULT_CASES)})")
    parser.add_argument("--sides", default=",".join(SIDES),
                        help=f"comma-separated, of: {', '.join(SIDES)} (default: every side that applies to a case; "
                             "raw, the baseline, always)")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run, every side (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per process, every side (default 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results JSON (default {DEFAULT_OUT})")
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep every run's log and run dir here")
    args = parser.parse_args(argv)
    if args.cases == "all":
        args.cases = ",".join(CASES)
    unknown = [name for name in args.cases.split(",") if name not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    sides = args.sides.split(",")
    if [side for side in sides if side not in SIDES] or "raw" not in sides:
        parser.error(f"--sides: comma-separated, of {', '.join(SIDES)}, raw (the baseline) among them")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    args.case_list = [CASES[name] if args.steps is None else replace(CASES[name], steps=args.steps)
                      for name in args.cases.split(",")]
    args.case_sides = {case.name: [side for side in case.sides if side in sides] for case in args.case_list}
    for case in args.case_list:
        if case.steps <= case.warmup_steps:
            parser.error(f"{case.name}: --steps {case.steps} leaves no timed step after {case.warmup_steps} "
                         "warm-up steps")
        if len(args.case_sides[case.name]) < 2:
            parser.error(f"{case.name} has none of the sides {args.sides} but raw; its sides: {', '.join(case.sides)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = wide_console(210)
    started = time.perf_counter()
    info = machine("lightning", "accelerate")
    runs: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="nodescale-overhead-") as tmp:
        workdir = args.keep_logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for repeat in range(args.repeats):
            for index, case in enumerate(args.case_list):
                # harness.interleave's order, with each case's own sides.
                for side in rotated(args.case_sides[case.name], repeat + index):
                    result = run_side(side, case, repeat, args, workdir)
                    runs.append(result)
                    console.print(
                        f"repeat {repeat + 1}/{args.repeats}  {case.name:<22} {side:<10} "
                        f"{result.step_seconds * 1e3:9.2f} ms/step  {result.samples_per_second:9.1f} samples/s  "
                        + (f"{result.tokens_per_second:9,.0f} tokens/s  " if result.tokens_per_second else "")
                        + f"(wall {result.wall_seconds:.1f} s)")
    summaries = [summarise(case, args.case_sides[case.name], [r for r in runs if r.case == case.name])
                 for case in args.case_list]
    console.print(results_table(summaries, args.nproc, args.threads))
    for line in ahead_lines(summaries):
        console.print(line)
    if any("tokens" in s for s in summaries):
        console.print(tokens_table(summaries))
    for s in summaries:
        for side, v in s["versus_raw"].items():
            if not v["like_for_like"]:
                console.print(f"[red]{s['case']} {side}: invalid comparison, it timed other steps or samples than "
                              "raw (see runs in the JSON)[/]")
    elapsed = time.perf_counter() - started
    console.print(f"total time {elapsed:.0f} s; load average at the end {os.getloadavg()}")
    write_results(args.out, info, {
        "nproc": args.nproc,
        "omp_num_threads": args.threads,
        "repeats": args.repeats,
        "sides": args.sides.split(","),
        "units": {"step_ms": "milliseconds per optimiser step (steady state, warm-up excluded)",
                  "samples_per_second": "samples per second over all ranks",
                  "tokens_per_second": "language models: tokens per second over all ranks (samples/s x seq_len)"},
        "targets": {"ratio_of_minima": TARGETS, "nodescale_ahead_of": ["lightning", "accelerate"]},
        "cases": summaries,
        "runs": [asdict(r) for r in runs],
        "total_seconds": elapsed,
        "load_average_at_end": os.getloadavg(),
    }, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
