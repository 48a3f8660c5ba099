"""Single-GPU training throughput of ``nodescale train`` against the best hand-written loop, with MFU.

For ResNet-50 and ViT-B/16 on synthetic images (224 px, 1000 classes), and GPT-2 small on
random GPT-2 token ids in 1024-token windows, each in one or more variants (precision,
channels_last, torch.compile), runs repeated, interleaved pairs of the hand-written loop
(``raw_throughput.py`` for images, ``raw_lm.py`` for the language model) and ``nodescale train
--strategy single`` (its summary.json), with the same architecture, batch, optimiser, precision,
steps and warm-up exclusion. It reports images/s or tokens/s of both, their ratio (target
>= 0.98), the MFU of both (3 x forward FLOPs, FlopCounterMode, against the GPU's peak in
``nodescale/bench/peaks.yaml``), peak memory and warm-up (compilation) time beside the
published ResNet-50 figure (one A100 80GB, AMP: 2,470 images/s). Cases and commands:
``throughput_cases.py``; what the figures mean: ``throughput_results.py``; fairness: README.md.

    python benchmarks/throughput.py                                # GPU: every model, the fast variants
    python benchmarks/throughput.py --quick                        # GPU: one variant per model
    python benchmarks/throughput.py --cases gpt2_small --quick     # GPU: GPT-2 small compiled, one pair, ~3 min
    python benchmarks/throughput.py --variants fp32,bf16,bf16+cl   # GPU: the ablation
    OMP_NUM_THREADS=1 python benchmarks/throughput.py --device cpu --image-size 32 --batch-size 4 \\
        --steps 6 --warmup 2 --cases resnet50 --variants fp32 --repeats 1   # CPU smoke test
    OMP_NUM_THREADS=1 python benchmarks/throughput.py --device cpu --seq-len 32 --batch-size 2 \
        --steps 4 --warmup 2 --cases gpt2_small --variants fp32 --repeats 1   # CPU smoke test, LM

It never runs past ``--hard-limit-s``: a pair of runs whose estimate would end after
``--budget-s`` is skipped. Results go to ``benchmarks/results/throughput.json`` (``--out``),
rewritten after every run, so a killed invocation keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import HERE, child_env, interleave, machine, run_logged, wide_console, write_results  # noqa: E402
from throughput_cases import (  # noqa: E402
    CASES,
    GPT2_VOCAB,
    QUICK_VARIANTS,
    VIT_PATCH,
    Point,
    command,
    guess_seconds,
    parse_variant,
    write_token_files,
)
from throughput_results import (  # noqa: E402
    SIDES,
    TARGET_RATIO,
    UNITS,
    against_reference,
    device_facts,
    fmt,
    nodescale_figures,
    raw_figures,
    reference_row,
    results_table,
    summarise,
    training_flops,
)

DEFAULT_OUT = HERE / "results" / "throughput.json"


@dataclass
class Run:
    """One training run of one side: its figures, or why there are none."""

    side: str
    point: str  # Point.key
    repeat: int
    wall_seconds: float  # the whole process: start-up, data, compilation, training, shutdown
    error: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


# --------------------------------------------------------------- running
def run_side(side: str, point: Point, repeat: int, args: argparse.Namespace, workdir: Path, left: float) -> Run:
    """One run of ``side``, killed after ``left`` seconds, with a compile cache of its own: every
    compilation is cold on both sides (with a shared cache the second side would load the first
    one's kernels and its warm-up would look shorter)."""
    name = f"{side}-{point.slug}-r{repeat}"
    run_dir, log, cache = workdir / name, workdir / f"{name}.log", args.cache_root / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun into a kept --keep-logs folder
    env = child_env(args.threads, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(cache),
                    TRITON_CACHE_DIR=str(cache / "triton"),
                    **({"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {}))  # nodescale takes any GPU
    try:
        done = run_logged(command(side, point, args, run_dir), env, log, left)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    run = Run(side, point.key, repeat, done.wall_seconds)
    try:
        done.check()
        run.figures = raw_figures(log) if side == "raw" else nodescale_figures(point, run_dir)
    except (RuntimeError, OSError, KeyError, ValueError) as exc:
        run.error = f"{exc} (log {log})"
    return run


# ------------------------------------------------------------------ plan
def nodescale_samples(batch_size: int, image_size: int, fixed: int | None) -> tuple[int, list[str]]:
    """nodescale's ``data.samples``: a multiple of 8 x batch, so training and validation (samples // 8)
    are whole batches (a partial batch would recompile a compiled model); as many as stay under
    nodescale's on-device limit (long epochs: each ends with an untimed validation), at most 4 units."""
    from nodescale.data.epoch_loader import RESIDENT_BYTES

    per_sample, unit = 3 * image_size**2 * 4 + 8, 8 * batch_size
    samples = fixed if fixed is not None else min(
        unit * max(1, int(RESIDENT_BYTES / (unit * per_sample * 1.125 * 1.02))), unit * 4)
    notes = []
    if samples % batch_size:
        notes.append(f"--samples {samples} is not a multiple of the batch {batch_size}: nodescale's last batch of "
                     "each epoch is partial")
    if samples * per_sample > RESIDENT_BYTES:
        notes.append(f"{samples} synthetic samples are {samples * per_sample / 1e9:.2f} GB, over nodescale's "
                     f"{RESIDENT_BYTES / 1e9:.2f} GB on-device limit: nodescale copies every batch from host memory")
    return samples, notes


def build_plan(args: argparse.Namespace) -> tuple[list[Point], list[str]]:
    points: list[Point] = []
    notes: list[str] = []
    for name in args.case_names:
        case = CASES[name]
        if args.variants == "auto":
            variants = [parse_variant(v) for v in (QUICK_VARIANTS[name] if args.quick else case.auto_variants)]
        else:
            variants = [v for v in args.variant_list if case.cnn or not v.channels_last]
            notes += [f"{name} {v.name}: skipped, channels_last applies to CNNs" for v in args.variant_list
                      if v not in variants]
        batch = args.batch_sizes[name]
        if case.language_model:  # one more batch of windows than the steps take: no epoch ends in a run
            points += [Point(name, v, batch, args.image_size, GPT2_VOCAB, args.steps, args.warmup,
                             (args.steps + 1) * batch, args.seq_len) for v in variants]
            continue
        samples, found = nodescale_samples(batch, args.image_size, args.samples)
        notes += [f"{name}: {note}" for note in found]
        points += [Point(name, v, batch, args.image_size, args.num_classes, args.steps, args.warmup, samples)
                   for v in variants]
    return points, notes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--cases", default="resnet50,vit_b16", help=f"comma-separated, of: {', '.join(CASES)} (default: the images)")
    add("--variants", default="auto", help="comma-separated PRECISION[+cl][+compile], PRECISION fp32 or bf16, cl = "
        "channels_last (CNNs only); default: " + "; ".join(f"{c.name} {', '.join(c.auto_variants)}"
                                                          for c in CASES.values()))
    add("--quick", action="store_true", help="one variant per model (" + ", ".join(
        f"{k} {'/'.join(v)}" for k, v in QUICK_VARIANTS.items()) + "), 1 repeat, 30 steps (~2-3 min each on a GPU)")
    add("--batch-size", default=None, help="N for every case, or per case (default " + ",".join(
        f"{c.name}={c.batch_size}" for c in CASES.values()) + ")")
    add("--seq-len", type=int, default=1024, help="tokens per window of the language model (default 1024)")
    add("--image-size", type=int, default=224)
    add("--num-classes", type=int, default=1000)
    add("--steps", type=int, default=None, help="optimiser steps per run, warm-up included (default 50; 30 quick)")
    add("--warmup", type=int, default=10, help="first steps excluded from the timing (default 10)")
    add("--repeats", type=int, default=None, help="runs of each side per variant, alternating (default 2; 1 quick)")
    add("--compile-repeats", type=int, default=1, help="repeats of the compiled variants (default 1)")
    add("--samples", type=int, default=None, help="nodescale's data.samples (default: 8 x batch multiples on the GPU)")
    add("--device", choices=("auto", "cuda", "cpu"), default="auto")
    add("--raw-model-source", choices=("auto", "torchvision", "nodescale"), default="auto",
        help="who builds the raw model (auto: torchvision if importable; nodescale: only the loops differ)")
    add("--no-raw-cudnn-benchmark", dest="raw_cudnn_benchmark", action="store_false",
        help="cudnn.benchmark off on the raw side (nodescale: train.cudnn_benchmark)")
    add("--raw-pool-batches", type=int, default=4, help="distinct batches the raw loop cycles through")
    add("--threads", type=int, default=None, help="OMP_NUM_THREADS of both sides (default: inherit)")
    add("--budget-s", type=float, default=540.0, help="skip a pair estimated to end after this (default 540)")
    add("--hard-limit-s", type=float, default=585.0, help="kill a run still going after this (default 585)")
    add("--out", type=Path, default=DEFAULT_OUT, help=f"results JSON (default {DEFAULT_OUT})")
    add("--keep-logs", type=Path, default=None, help="keep every run's log and run dir here")
    add("--dry-run", action="store_true", help="print the plan and its time estimate only")
    args = parser.parse_args(argv)
    args.case_names = [name.strip() for name in args.cases.split(",") if name.strip()]
    if not args.case_names or any(name not in CASES for name in args.case_names):
        parser.error(f"--cases {args.cases}: choose from {', '.join(CASES)}")
    args.steps = args.steps or (30 if args.quick else 50)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if args.repeats < 1 or args.compile_repeats < 1 or args.warmup < 1 or args.steps <= args.warmup:
        parser.error("--repeats, --compile-repeats and --warmup (the first step carries start-up and compilation) "
                     "must be at least 1, and --steps more than --warmup")
    if "vit_b16" in args.case_names and args.image_size % VIT_PATCH:
        parser.error(f"vit_b16 needs an --image-size divisible by {VIT_PATCH}")
    try:
        text = args.batch_size or ""  # N for every case, or NAME=N,... (the others keep their default)
        given = {n: text for n in args.case_names} if text and "=" not in text else dict(
            part.strip().split("=", 1) for part in text.split(",") if part.strip())
        if any(name not in CASES for name in given):
            raise ValueError(f"--batch-size {text}: cases are {', '.join(CASES)}")
        args.batch_sizes = {name: int(given.get(name) or CASES[name].batch_size) for name in args.case_names}
        args.variant_list = [] if args.variants == "auto" else [
            parse_variant(v) for v in args.variants.split(",") if v.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    console = wide_console(230)
    import torch  # after parsing: --help stays fast

    if args.device == "cuda" and not torch.cuda.is_available():
        console.print("[red]--device cuda, but torch sees no CUDA device[/]")
        return 2
    args.device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    from raw_throughput import torchvision_available

    args.raw_source = args.raw_model_source
    if args.raw_source == "auto":
        args.raw_source = "torchvision" if torchvision_available() else "nodescale"
    points, notes = build_plan(args)
    ordered = sorted(points, key=lambda p: p.variant.compile)  # eager first: a short budget still measures them
    order = [(repeat, point, sides) for repeat, point, sides in
             interleave(max(args.repeats, args.compile_repeats), ordered, SIDES)
             if repeat < (args.compile_repeats if point.variant.compile else args.repeats)]
    on_gpu = args.device == "cuda"
    console.print(f"throughput: {len(points)} case/variant(s), {args.repeats} repeat(s) of each side "
                  f"({args.compile_repeats} compiled) = {2 * len(order)} runs on {args.device}; raw model from "
                  f"{args.raw_source}; {args.steps} steps, {args.warmup} warm-up")
    for point in points:
        pair = guess_seconds(point, "raw") + guess_seconds(point, "nodescale")
        data = (f"{point.seq_len}-token windows, {point.samples} of random ids" if point.seq_len else
                f"{point.image_size} px, nodescale data.samples={point.samples}")
        console.print(f"  {point.key:<24} batch {point.batch_size}, {data}" + (f", ~{pair:.0f} s per pair" if on_gpu
                                                                                else ""))
    for note in notes:
        console.print(f"  note: {note}")
    if on_gpu:
        estimate = sum(guess_seconds(p, side) for _, p, sides in order for side in sides)
        console.print(f"estimated {estimate / 60:.1f} min (rough H100 guesses); budget {args.budget_s:.0f} s: a pair "
                      "that would end after it is skipped" + (" [yellow](some may be)[/]" if estimate > args.budget_s
                                                              else ""))
    if not points or args.dry_run:
        return 0 if points else 2

    flops = {point.key: training_flops(point) for point in points}  # per sample: counter, note, 6N + 12LdT
    resnet = next((point for point in points if point.case == "resnet50"), None)
    reference = (reference_row(flops[resnet.key][0])
                 if resnet is not None and (args.image_size, args.num_classes) == (224, 1000) else None)
    info = machine("torchvision")
    env_threads = str(args.threads) if args.threads is not None else os.environ.get("OMP_NUM_THREADS")
    runs: list[Run] = []
    skipped: list[dict[str, Any]] = []
    observed: dict[tuple[str, str], float] = {}

    def save(final: bool) -> dict[str, Any]:
        """The results file as it stands (rewritten after every run); returns its body."""
        info.update(device_facts(runs))
        body = {"benchmark": "throughput", "complete": final and not skipped and all(r.ok for r in runs),
                "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                if k not in ("variant_list", "cache_root", "token_dirs")},
                             "omp_num_threads": env_threads},
                "units": UNITS, "target_ratio": TARGET_RATIO, "reference": reference, "notes": notes,
                "cases": [summarise(p, CASES[p.case].description, runs, *flops[p.key]) for p in points],
                "runs": [asdict(r) for r in runs], "skipped": skipped, "total_seconds": time.perf_counter() - started}
        write_results(args.out, info, body, console if final else None)
        return body

    with tempfile.TemporaryDirectory(prefix="nodescale-throughput-") as tmp:
        workdir = args.keep_logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        args.cache_root = Path(tmp) / "compile-cache"
        args.token_dirs = {p.case: write_token_files(Path(tmp) / f"tokens-{p.case}", p) for p in points if p.seq_len}
        for repeat, point, sides in order:
            # A pair runs whole or not at all: one side alone compares nothing.
            elapsed = time.perf_counter() - started
            needed = sum(observed.get((point.key, side)) or (guess_seconds(point, side) if on_gpu else 0.0)
                         for side in sides)
            if elapsed + needed > args.budget_s or args.hard_limit_s - elapsed < 10:
                reason = f"time budget: {elapsed:.0f} s gone, ~{needed:.0f} s more needed, budget {args.budget_s:.0f} s"
                skipped += [{"repeat": repeat, "point": point.key, "side": side, "reason": reason} for side in sides]
                console.print(f"repeat {repeat + 1}  {point.key:<24} skipped ({reason})")
                continue
            for side in sides:
                left = args.hard_limit_s - (time.perf_counter() - started)
                if left < 10:
                    skipped.append({"repeat": repeat, "point": point.key, "side": side, "reason": "hard limit"})
                    continue
                run = run_side(side, point, repeat, args, workdir, left)
                runs.append(run)
                observed[(point.key, side)] = max(observed.get((point.key, side), 0.0), run.wall_seconds)
                f, unit = run.figures, CASES[point.case].unit
                console.print(f"repeat {repeat + 1}  {point.key:<24} {side:<9} " + (
                    f"{f.get(unit + '_per_second') or f['samples_per_second']:10,.1f} {unit[:3]}/s  "
                    f"{f['step_seconds'] * 1e3:9.2f} ms/step  warm-up "
                    f"{fmt(f['warmup_seconds'], '.1f')} s  (wall {run.wall_seconds:.1f} s)" if run.ok
                    else "[red]failed:[/] " + escape(run.error or "")))
                save(final=False)  # a killed invocation keeps what it measured
    body = save(final=True)
    console.print(results_table(body["cases"], reference, args.device))
    for s in body["cases"]:
        for note in s["notes"]:
            console.print(f"{s['case']} {s['variant']}: {note}")
    if reference is not None and against_reference(body["cases"]):
        console.print(against_reference(body["cases"]))
    console.print(f"device {info.get('gpu') or 'unknown'}; torch {info['torch_version']}, CUDA "
                  f"{info.get('cuda_version')}, cuDNN {info.get('cudnn_version')}, torchvision "
                  f"{info.get('torchvision_version')}; total time {time.perf_counter() - started:.0f} s")
    if skipped:
        console.print(f"[yellow]{len(skipped)} run(s) skipped for the time budget (see 'skipped' in the JSON)[/]")
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
