"""Single-GPU training throughput of ``nodescale train`` against the best hand-written loop, with MFU.

For ResNet-50 and ViT-B/16 on synthetic 224x224 images (1000 classes), each in one or more
variants (precision, channels_last, torch.compile), runs, in one invocation, repeated and
interleaved pairs of

* ``benchmarks/raw_throughput.py`` (plain PyTorch: torchvision's model, data made once on the
  device, fused AdamW, bf16 autocast, channels_last, CUDA-event timing), and
* ``nodescale train --strategy single --dataset synthetic ...`` (its ``summary.json``),

with the same model architecture, batch size, optimiser, precision, number of steps and warm-up
exclusion, and reports images/s of both, their ratio, the model FLOPs utilisation (MFU) of
both (training FLOPs = 3 x the forward FLOPs counted by torch's FlopCounterMode, against the
GPU's peak from ``nodescale/bench/peaks.yaml``), peak memory and warm-up (compilation) time,
next to the published ResNet-50 reference (NVIDIA DeepLearningExamples, one A100 80GB, AMP:
2,470 images/s).

    python benchmarks/throughput.py                           # GPU: both models, the fast variants
    python benchmarks/throughput.py --quick                   # GPU: one eager variant per model, ~2 min
    python benchmarks/throughput.py --variants fp32,bf16,bf16+cl   # GPU: the ablation
    OMP_NUM_THREADS=1 python benchmarks/throughput.py --device cpu --image-size 32 --batch-size 4 \\
        --steps 6 --warmup 2 --cases resnet50 --variants fp32 --repeats 1   # CPU smoke test

Results go to ``benchmarks/results/throughput.json`` (``--out``), rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SRC = REPO / "src"
# The working tree's nodescale, whatever is installed: that is the code being measured.
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(HERE))
from record import cpu_model, stamp, wide_console, write_results  # noqa: E402

from nodescale.atomic_files import write_json_atomic  # noqa: E402

RAW_SCRIPT = HERE / "raw_throughput.py"
RAW_PREFIX = "RAW_THROUGHPUT_RESULT "
DEFAULT_OUT = HERE / "results" / "throughput.json"
TARGET_RATIO = 0.98  # nodescale/raw images per second: overhead.py's 2% on step time
UNBOUNDED_EPOCHS = 1_000_000
VIT_PATCH = 16
# nodescale keeps an in-memory dataset on the GPU up to this size (nodescale.data.epoch_loader.RESIDENT_BYTES);
# above it every batch is copied from host memory. Read from there when importable.
FALLBACK_RESIDENT_BYTES = 2 * 1024**3

# Variables a launcher sets in its workers: nodescale would take them for its own rank.
LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
)

REFERENCE = {
    "what": "ResNet-50 v1.5 training, AMP (fp16), one A100 80GB, batch 256",
    "images_per_second": 2470.0,
    "source": "NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5 training performance (DGX A100 80GB, 1 GPU)",
    "device": "NVIDIA A100-SXM4-80GB",
    "peak_dtype": "fp16",
    "note": "published figure, not measured here: real ImageNet data through DALI, fp16 AMP, another GPU",
}


# ------------------------------------------------------------------ plan
@dataclass(frozen=True)
class Case:
    """One model, measured in each variant."""

    name: str  # nodescale's model name (and raw_throughput.py's --model)
    batch_size: int  # default for an 80 GB GPU
    cnn: bool  # channels_last applies
    description: str
    auto_variants: tuple[str, ...]


CASES: dict[str, Case] = {
    "resnet50": Case("resnet50", 256, True, "ResNet-50 v1.5 (torchvision's layout, ImageNet stem)",
                     ("bf16+cl", "bf16+cl+compile")),
    "vit_b16": Case("vit_b16", 128, False, "ViT-B/16 (768 wide, 12 blocks, SDPA attention)",
                    ("bf16", "bf16+compile")),
}
QUICK_VARIANTS = {"resnet50": ("bf16+cl",), "vit_b16": ("bf16",)}


@dataclass(frozen=True)
class Variant:
    name: str
    precision: str  # fp32 or bf16
    channels_last: bool
    compile: bool


def parse_variant(text: str) -> Variant:
    """``bf16+cl+compile`` -> Variant; the precision first, then any of ``cl`` and ``compile``."""
    tokens = [t.strip().lower() for t in text.split("+") if t.strip()]
    if not tokens or tokens[0] not in ("fp32", "bf16"):
        raise ValueError(f"variant {text!r}: start with the precision, fp32 or bf16 (e.g. bf16+cl+compile)")
    extras = tokens[1:]
    unknown = [t for t in extras if t not in ("cl", "compile")]
    if unknown or len(set(extras)) != len(extras):
        raise ValueError(f"variant {text!r}: after the precision only 'cl' and 'compile', each once")
    cl, compiled = "cl" in extras, "compile" in extras
    name = tokens[0] + ("+cl" if cl else "") + ("+compile" if compiled else "")
    return Variant(name, tokens[0], cl, compiled)


@dataclass(frozen=True)
class Point:
    """One case in one variant: what both sides run, identically."""

    case: str
    variant: Variant
    batch_size: int
    image_size: int
    num_classes: int
    steps: int  # optimiser steps in total, warm-up included
    warmup_steps: int
    samples: int  # nodescale's data.samples (raw keeps --raw-pool-batches batches instead)

    @property
    def key(self) -> str:
        return f"{self.case} {self.variant.name}"

    @property
    def slug(self) -> str:  # file names: no '+' or spaces
        return f"{self.case}-{self.variant.name.replace('+', '_')}"

    @property
    def timed_steps(self) -> int:
        return self.steps - self.warmup_steps


@dataclass
class RunResult:
    """One training run of one side."""

    side: str  # "raw" or "nodescale"
    point: str  # Point.key
    repeat: int
    ok: bool
    error: str | None = None
    samples_per_second: float | None = None
    step_seconds: float | None = None
    timed_steps: int | None = None
    timed_samples: int | None = None
    peak_memory_bytes: int | None = None
    peak_memory_kind: str | None = None
    data_bytes: int | None = None  # the synthetic data this side keeps (on the GPU, when resident)
    warmup_seconds: float | None = None  # the first warm-up steps, compilation included; None if not seen
    wall_seconds: float = 0.0  # the whole process: start-up, data, compilation, training, shutdown
    device_name: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------- estimates
# Rough H100 figures, only to plan the time budget; replaced by what each run actually took.
GUESS_IMAGES_PER_SECOND = {("resnet50", "fp32"): 1000.0, ("resnet50", "bf16"): 2300.0,
                           ("vit_b16", "fp32"): 350.0, ("vit_b16", "bf16"): 900.0}
GUESS_START_SECONDS = {"raw": 12.0, "nodescale": 15.0}
GUESS_COMPILE_SECONDS = {"raw": 60.0, "nodescale": 90.0}  # nodescale also compiles eval mode for validation


def guess_seconds(point: Point, side: str) -> float:
    rate = GUESS_IMAGES_PER_SECOND.get((point.case, point.variant.precision), 500.0)
    rate *= (224 / point.image_size) ** 2
    rate *= 1.15 if point.variant.channels_last else 1.0
    seconds = GUESS_START_SECONDS[side] + point.steps * point.batch_size / rate
    if side == "nodescale":  # its data drawn on the host, and a validation pass per epoch
        seconds += point.samples * 3 * point.image_size**2 * 4 / 0.3e9 + 0.05 * point.steps
    if point.variant.compile:
        seconds += GUESS_COMPILE_SECONDS[side]
    return seconds


# --------------------------------------------------------------- running
@dataclass
class Context:
    device: str  # cuda or cpu
    workdir: Path
    env: dict[str, str]
    raw_model_source: str
    raw_cudnn_benchmark: bool
    raw_pool_batches: int
    started: float
    hard_limit_s: float
    cache_root: Path

    def remaining(self) -> float:
        return self.hard_limit_s - (time.perf_counter() - self.started)

    def run(self, cmd: list[str], log: Path, name: str) -> tuple[int | None, float]:
        """``cmd`` with a compile cache of its own: every compilation is cold, on both sides alike.

        (With a shared cache the side that goes second would load the first one's kernels when the
        graphs match, and its warm-up would look shorter.) The cache is deleted afterwards.
        """
        cache = self.cache_root / name
        env = {**self.env, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
        try:
            return run_logged(cmd, env, log, self.remaining())
        finally:
            shutil.rmtree(cache, ignore_errors=True)


def child_env(args: argparse.Namespace, device: str) -> dict[str, str]:
    """The environment of both sides: the working tree's nodescale, the same threads, no launcher variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env["PYTHONUNBUFFERED"] = "1"
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # nodescale picks the GPU whenever it sees one
    return env


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> tuple[int | None, float]:
    """Run ``cmd`` with its output in ``log``; (exit code or None if killed at ``timeout``, wall seconds)."""
    started = time.perf_counter()
    with log.open("w") as handle:
        handle.write("$ " + shlex.join(cmd) + "\n")
        handle.flush()
        # A session of its own, so a timeout kills the whole process group (compile workers too).
        proc = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            # SIGKILL: nodescale turns SIGTERM into "checkpoint at the next step", which could take long.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            code = None
    return code, time.perf_counter() - started


def log_tail(log: Path, lines: int = 25) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def failure(side: str, point: Point, repeat: int, code: int | None, wall: float, log: Path) -> RunResult:
    what = "killed at the hard time limit (--hard-limit-s)" if code is None else f"exit code {code}"
    return RunResult(side, point.key, repeat, ok=False, error=f"{what}; log {log}:\n{log_tail(log)}",
                     wall_seconds=wall)


def raw_command(point: Point, ctx: Context, json_out: Path) -> list[str]:
    variant = point.variant
    cmd = [
        sys.executable, str(RAW_SCRIPT),
        "--model", point.case, "--model-source", ctx.raw_model_source,
        "--image-size", str(point.image_size), "--num-classes", str(point.num_classes),
        "--batch-size", str(point.batch_size), "--steps", str(point.steps), "--warmup-steps", str(point.warmup_steps),
        "--precision", variant.precision, "--pool-batches", str(ctx.raw_pool_batches),
        "--device", ctx.device, "--json-out", str(json_out),
    ]
    if variant.channels_last:
        cmd.append("--channels-last")
    if variant.compile:
        cmd.append("--compile")
    if not ctx.raw_cudnn_benchmark:
        cmd.append("--no-cudnn-benchmark")
    return cmd


def nodescale_command(point: Point, run_dir: Path) -> list[str]:
    variant = point.variant
    cmd = [
        sys.executable, "-m", "nodescale", "train", "--strategy", "single",
        "--model", point.case, "--dataset", "synthetic", "--batch-size", str(point.batch_size),
        # nodescale stops at whichever comes first, epochs or max-steps: the epochs must never bind.
        "--max-steps", str(point.steps), "--epochs", str(UNBOUNDED_EPOCHS),
        "--precision", variant.precision, "--out", str(run_dir), "--no-progress",
        "--set", f"data.image_size={point.image_size}", "--set", f"data.samples={point.samples}",
        "--set", f"data.num_classes={point.num_classes}",
        "--set", "optim.schedule=constant",  # the raw loop's learning rate is constant too
        "--set", f"train.timing_warmup_steps={point.warmup_steps}",
        "--set", "checkpoint.at_end=false",  # outside the clock anyway; saves wall time
    ]
    # The architecture torchvision builds, at every image size: the ImageNet stem (auto picks
    # the CIFAR stem up to 64 px) and 16-pixel patches (auto shrinks them for small images).
    if CASES[point.case].cnn:
        cmd += ["--set", "model.stem=imagenet"]
    else:
        cmd += ["--set", f"model.patch_size={VIT_PATCH}"]
    if variant.channels_last:
        cmd.append("--channels-last")
    if variant.compile:
        cmd.append("--compile")
    return cmd


def run_raw(point: Point, repeat: int, ctx: Context) -> RunResult:
    json_out = ctx.workdir / f"raw-{point.slug}-r{repeat}.json"
    log = json_out.with_suffix(".log")
    code, wall = ctx.run(raw_command(point, ctx, json_out), log, f"raw-{point.slug}-r{repeat}")
    if code != 0 or not json_out.is_file():
        return failure("raw", point, repeat, code, wall, log)
    data = json.loads(json_out.read_text())
    warmup = data.get("warmup_step_seconds") or []
    return RunResult(
        "raw", point.key, repeat, ok=True,
        samples_per_second=data["samples_per_second"], step_seconds=data["step_seconds"],
        timed_steps=data["timed_steps"], timed_samples=data["timed_samples"],
        peak_memory_bytes=data["peak_memory_bytes"], peak_memory_kind=data["peak_memory_kind"],
        data_bytes=data["data_bytes"], warmup_seconds=sum(warmup) if warmup else None,
        wall_seconds=wall, device_name=data.get("device_name"),
        details={k: data.get(k) for k in (
            "model_source", "parameters", "training_flops_per_sample", "timing", "host_timed_seconds",
            "timed_seconds", "first_step_seconds", "warmup_step_seconds", "setup_seconds",
            "graphs_compiled_during_timing", "final_loss", "finite_loss", "cudnn_benchmark", "fused_optimizer",
            "device_capability", "device_memory_bytes", "cuda_version", "cudnn_version", "torch_version",
            "torchvision_version", "python_version", "torch_threads")},
    )


def nodescale_warmup_seconds(run_dir: Path, warmup_steps: int) -> float | None:
    """Seconds of nodescale's first ``warmup_steps`` optimiser steps, from its metrics.jsonl.

    Each ``step`` record covers the steps since the one before (validation excluded). The sum is
    known only when a record falls exactly on the last warm-up step (log_every 10 and warm-up 10
    by default); otherwise None.
    """
    path = run_dir / "metrics.jsonl"
    if not path.is_file() or warmup_steps < 1:
        return None
    total, previous = 0.0, 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") != "step" or record.get("step_seconds") is None:
            continue
        step = int(record["step"])
        if step > warmup_steps:
            return None
        total += float(record["step_seconds"]) * (step - previous)
        previous = step
        if step == warmup_steps:
            return total
    return None


def nodescale_data_bytes(point: Point) -> int:
    """What nodescale's synthetic dataset holds: train and validation images (float32) and labels (int64)."""
    per_sample = 3 * point.image_size**2 * 4 + 8
    return (point.samples + max(1, point.samples // 8)) * per_sample


def run_nodescale(point: Point, repeat: int, ctx: Context) -> RunResult:
    run_dir = ctx.workdir / f"nodescale-{point.slug}-r{repeat}"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a rerun into a kept --keep-logs folder
    log = ctx.workdir / f"nodescale-{point.slug}-r{repeat}.log"
    code, wall = ctx.run(nodescale_command(point, run_dir), log, f"nodescale-{point.slug}-r{repeat}")
    summary_path = run_dir / "summary.json"
    if code != 0 or not summary_path.is_file():
        return failure("nodescale", point, repeat, code, wall, log)
    data = json.loads(summary_path.read_text())
    result = RunResult(
        "nodescale", point.key, repeat, ok=True,
        samples_per_second=data["samples_per_second"], step_seconds=data["step_seconds"],
        timed_steps=data["timed_steps"], timed_samples=data["timed_samples"],
        peak_memory_bytes=data["peak_memory_bytes"], peak_memory_kind=data["peak_memory_kind"],
        data_bytes=nodescale_data_bytes(point), warmup_seconds=nodescale_warmup_seconds(run_dir, point.warmup_steps),
        wall_seconds=wall, device_name=data.get("device"),
        details={k: data.get(k) for k in ("wall_seconds", "data_wait_fraction", "timing_includes_warmup",
                                           "epochs_completed", "global_steps", "state_bytes_per_rank",
                                           "torch_version", "python_version", "val_loss")},
    )
    if data.get("timing_includes_warmup"):
        result.ok = False
        result.error = "nodescale timed its warm-up too (too few steps); use more --steps"
    return result


# -------------------------------------------------------------- analysis
def device_peak(device_name: str | None, precision: str) -> dict[str, Any]:
    """The peak FLOP/s an MFU of this precision is measured against, or why there is none."""
    from nodescale.bench import peaks

    entry = peaks.find_peak(device_name)
    dtype = peaks.peak_dtype(precision, entry)
    flops = entry.flops(dtype) if entry is not None else None
    if device_name is None:
        note = "no run reported its device: MFU unknown"
    elif entry is None:
        note = f"no peak for {device_name!r} in nodescale/bench/peaks.yaml: MFU unknown"
    elif flops is None:
        note = f"{device_name} has no {dtype} peak in peaks.yaml: MFU unknown"
    else:
        note = None
    return {"device": device_name, "dtype": dtype, "flops": flops,
            "tflops": None if flops is None else flops / 1e12, "source": entry.source if entry else None,
            "note": note}


def training_flops(case: str, image_size: int, num_classes: int) -> tuple[int | None, str | None]:
    """nodescale's count for the model both sides train: 3 x forward FLOPs (FlopCounterMode, meta device)."""
    try:
        import torch

        from nodescale.config.schema import ModelSection
        from nodescale.models.introspect import training_flops_per_sample
        from nodescale.models.registry import build_model
        from nodescale.models.spec import InputSpec

        section = (ModelSection(name=case, stem="imagenet") if CASES[case].cnn
                   else ModelSection(name=case, patch_size=VIT_PATCH))
        spec = InputSpec((3, image_size, image_size), num_classes)
        with torch.device("meta"):
            model = build_model(section, spec)
        return training_flops_per_sample(model, spec), None
    except Exception as exc:  # noqa: BLE001 - the MFU is then unknown, with the reason
        return None, f"FLOPs not counted: {type(exc).__name__}: {exc}"


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(point: Point, runs: list[RunResult], flops: int | None, flops_note: str | None) -> dict[str, Any]:
    """Medians of each side, their ratio, MFU and the checks of one case and variant."""
    from nodescale.bench.scaling_math import mfu

    mine = [r for r in runs if r.point == point.key]
    raw = [r for r in mine if r.side == "raw" and r.ok]
    ns = [r for r in mine if r.side == "nodescale" and r.ok]
    failed = [r for r in mine if not r.ok]
    raw_sps = median_or_none([r.samples_per_second for r in raw if r.samples_per_second])
    ns_sps = median_or_none([r.samples_per_second for r in ns if r.samples_per_second])
    ratio = ns_sps / raw_sps if raw_sps and ns_sps else None
    raw_by_repeat = {r.repeat: r.samples_per_second for r in raw}
    paired = [n.samples_per_second / raw_by_repeat[n.repeat] for n in ns
              if raw_by_repeat.get(n.repeat) and n.samples_per_second]
    both = raw + ns
    same_steps = len({r.timed_steps for r in both}) == 1 and bool(raw) and bool(ns)
    same_samples = len({r.timed_samples for r in both}) == 1 and bool(raw) and bool(ns)
    like_for_like = same_steps and same_samples
    device_name = next((r.device_name for r in both if r.device_name), None)
    peak = device_peak(device_name, point.variant.precision)
    raw_flops = next((r.details.get("training_flops_per_sample") for r in raw
                      if r.details.get("training_flops_per_sample")), None)
    raw_params = next((r.details.get("parameters") for r in raw if r.details.get("parameters")), None)
    notes = [n for n in (flops_note, peak["note"]) if n]
    if flops and raw_flops and abs(raw_flops - flops) > 0.01 * flops:
        notes.append(f"the raw model counts {raw_flops:.4g} training FLOPs per sample, nodescale's {flops:.4g}: "
                     "not the same architecture")
    if any(r.details.get("graphs_compiled_during_timing") for r in raw):
        notes.append("raw: torch.compile compiled a graph inside the timed steps (raise --warmup)")
    if any(r.details.get("finite_loss") is False for r in raw):
        notes.append("raw: the final loss was not finite")
    if raw and ns and not like_for_like:
        notes.append("invalid: the two sides timed different numbers of steps or samples")

    def memory(rs: list[RunResult]) -> dict[str, Any]:
        peaks_ = [r.peak_memory_bytes for r in rs if r.peak_memory_bytes is not None]
        data = next((r.data_bytes for r in rs if r.data_bytes is not None), None)
        kind = next((r.peak_memory_kind for r in rs if r.peak_memory_kind), None)
        top = max(peaks_) if peaks_ else None
        excluding = top - data if top is not None and data is not None and kind == "cuda_max_allocated" else None
        return {"peak_bytes": top, "kind": kind, "data_bytes": data, "peak_bytes_excluding_data": excluding}

    if failed:
        notes.append(f"{len(failed)} run(s) failed: see runs[].error in the JSON and the logs")
    if not mine:
        status = "skipped"  # the time budget ran out before this case and variant
    elif not raw or not ns:
        status = "failed" if not (raw or ns) else "incomplete"
    elif not like_for_like:
        status = "invalid"
    else:
        status = "pass" if ratio is not None and ratio >= TARGET_RATIO else "slower"
    return {
        "case": point.case,
        "variant": point.variant.name,
        "config": {**{k: v for k, v in asdict(point).items() if k != "variant"}, **asdict(point.variant),
                   "timed_steps": point.timed_steps},
        "description": CASES[point.case].description,
        "status": status,
        "raw_images_per_second": [r.samples_per_second for r in raw],
        "nodescale_images_per_second": [r.samples_per_second for r in ns],
        "raw_images_per_second_median": raw_sps,
        "nodescale_images_per_second_median": ns_sps,
        "ratio": ratio,
        "paired_ratios": paired,
        "target_ratio": TARGET_RATIO,
        "raw_step_ms_median": median_or_none([r.step_seconds * 1e3 for r in raw if r.step_seconds]),
        "nodescale_step_ms_median": median_or_none([r.step_seconds * 1e3 for r in ns if r.step_seconds]),
        "training_flops_per_sample": flops,
        "raw_training_flops_per_sample": raw_flops,
        "raw_parameters": raw_params,
        "raw_model_source": next((r.details.get("model_source") for r in raw), None),
        "peak": {k: v for k, v in peak.items() if k != "flops"},
        "raw_mfu": mfu(raw_sps, flops, peak["flops"], 1),
        "nodescale_mfu": mfu(ns_sps, flops, peak["flops"], 1),
        "raw_achieved_tflops": raw_sps * flops / 1e12 if raw_sps and flops else None,
        "nodescale_achieved_tflops": ns_sps * flops / 1e12 if ns_sps and flops else None,
        "raw_memory": memory(raw),
        "nodescale_memory": memory(ns),
        # The first warm-up steps, compilation and autotuning included (every run compiles cold).
        "raw_warmup_seconds_max": max((r.warmup_seconds for r in raw if r.warmup_seconds is not None), default=None),
        "nodescale_warmup_seconds_max": max((r.warmup_seconds for r in ns if r.warmup_seconds is not None),
                                            default=None),
        "raw_wall_seconds": [round(r.wall_seconds, 2) for r in raw],
        "nodescale_wall_seconds": [round(r.wall_seconds, 2) for r in ns],
        "same_timed_steps": same_steps,
        "same_timed_samples": same_samples,
        "like_for_like": like_for_like,
        "failed_runs": len(failed),
        "notes": notes,
    }


def reference_row(flops_by_case: dict[str, int | None], image_size: int, num_classes: int) -> dict[str, Any] | None:
    """The published A100 figure with its MFU by the same FLOP count (ResNet-50 at 224 px, 1000 classes only)."""
    flops = flops_by_case.get("resnet50")
    if image_size != 224 or num_classes != 1000 or "resnet50" not in flops_by_case:
        return None
    from nodescale.bench import peaks
    from nodescale.bench.scaling_math import mfu

    entry = peaks.find_peak(REFERENCE["device"])
    peak_flops = entry.flops(REFERENCE["peak_dtype"]) if entry else None
    return {**REFERENCE, "training_flops_per_sample": flops,
            "mfu": mfu(REFERENCE["images_per_second"], flops, peak_flops, 1),
            "peak_tflops": None if peak_flops is None else peak_flops / 1e12}


# ----------------------------------------------------------------- output
def fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def pct(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.1%}"


def gb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def results_table(summaries: list[dict[str, Any]], reference: dict[str, Any] | None, device: str) -> Any:
    from rich.table import Table

    memory_note = "peak GB excl. data" if device == "cuda" else "peak host RSS GB"
    table = Table(title="Training images/s, one device, median of repeats (higher is better); "
                        "ratio = nodescale/raw, target >= " + f"{TARGET_RATIO:.2f}")
    columns = [("case", "left"), ("variant", "left"), ("batch", "right"), ("raw img/s", "right"),
               ("nodescale img/s", "right"), ("ratio", "right"), ("paired", "right"), ("result", "center"),
               ("raw MFU", "right"), ("nodescale MFU", "right"), ("peak", "left"),
               ("raw step ms", "right"), ("ns step ms", "right"), (f"{memory_note} raw/ns", "right"),
               ("warm-up s raw/ns", "right")]
    for header, justify in columns:
        table.add_column(header, justify=justify, no_wrap=header in ("case", "variant"))  # type: ignore[arg-type]
    styles = {"pass": "[green]pass[/]", "slower": "[red]slower[/]", "invalid": "[red]invalid[/]",
              "incomplete": "[yellow]incomplete[/]", "failed": "[red]failed[/]", "skipped": "[yellow]skipped[/]"}
    for s in summaries:
        peak = s["peak"]
        peak_text = f"{peak['dtype']} {peak['tflops']:.0f} TF" if peak.get("tflops") else "unknown"
        mem_key = "peak_bytes_excluding_data" if device == "cuda" else "peak_bytes"
        paired = s["paired_ratios"]
        table.add_row(
            s["case"], s["variant"], str(s["config"]["batch_size"]),
            fmt(s["raw_images_per_second_median"], ",.1f"), fmt(s["nodescale_images_per_second_median"], ",.1f"),
            fmt(s["ratio"], ".3f"), f"{min(paired):.3f}-{max(paired):.3f}" if paired else "-",
            styles.get(s["status"], s["status"]),
            pct(s["raw_mfu"]), pct(s["nodescale_mfu"]), peak_text,
            fmt(s["raw_step_ms_median"], ",.2f"), fmt(s["nodescale_step_ms_median"], ",.2f"),
            f"{gb(s['raw_memory'][mem_key])} / {gb(s['nodescale_memory'][mem_key])}",
            f"{fmt(s['raw_warmup_seconds_max'], '.1f')} / {fmt(s['nodescale_warmup_seconds_max'], '.1f')}",
        )
    if reference is not None:
        table.add_row("resnet50", "reference", "256", f"{reference['images_per_second']:,.0f}", "", "", "", "",
                      pct(reference["mfu"]), "",
                      f"{reference['peak_dtype']} {reference['peak_tflops']:.0f} TF" if reference["peak_tflops"]
                      else "unknown", "", "", "", "", style="dim")
    return table


def machine_info(device: str) -> dict[str, Any]:
    import torch

    cpu = cpu_model()
    info: dict[str, Any] = {
        "device": device,
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
    }
    if device == "cuda" and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=True).stdout
            info["nvidia_smi"] = [line.strip() for line in out.splitlines() if line.strip()]
        except (subprocess.SubprocessError, OSError) as exc:
            info["nvidia_smi"] = f"failed: {exc}"
    return info


def fill_machine_from_runs(info: dict[str, Any], runs: list[RunResult]) -> None:
    """The GPU and the versions the children saw (the harness never initialises CUDA itself)."""
    raw = next((r for r in runs if r.side == "raw" and r.ok), None)
    if raw is not None:
        info["gpu"] = raw.device_name
        for key in ("device_capability", "device_memory_bytes", "cuda_version", "cudnn_version",
                    "torchvision_version"):
            info[key] = raw.details.get(key)
    ns = next((r for r in runs if r.side == "nodescale" and r.ok), None)
    if ns is not None:
        info.setdefault("gpu", ns.device_name)
        info["nodescale_device"] = ns.device_name


# ------------------------------------------------------------------ main
def parse_batch_sizes(text: str | None, cases: list[str]) -> dict[str, int]:
    sizes = {name: CASES[name].batch_size for name in cases}
    if not text:
        return sizes
    if "=" not in text:
        return {name: int(text) for name in cases}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in CASES:
            raise ValueError(f"--batch-size: unknown case {name.strip()!r}")
        sizes[name.strip()] = int(value)
    return {name: sizes[name] for name in cases}


def resident_bytes() -> int:
    try:
        from nodescale.data.epoch_loader import RESIDENT_BYTES

        return int(RESIDENT_BYTES)
    except Exception:  # noqa: BLE001
        return FALLBACK_RESIDENT_BYTES


def nodescale_samples(batch_size: int, image_size: int, fixed: int | None) -> tuple[int, str | None]:
    """nodescale's ``data.samples``: whole batches in training and validation, resident on the GPU if possible.

    A multiple of 8 x batch, so every training batch is full and the validation set
    (samples // 8) is whole batches too (a partial batch would recompile a compiled model).
    As many as fit nodescale's on-device limit, for long epochs: each epoch ends with an
    (untimed) validation pass and two device synchronisations.
    """
    per_sample = 3 * image_size**2 * 4 + 8
    unit = 8 * batch_size
    if fixed is not None:
        samples = fixed
    else:
        limit = resident_bytes()
        # Training and validation (1/8 more) together under the limit.
        samples = unit * max(1, int(limit / (unit * per_sample * 1.125 * 1.02)))
        samples = min(samples, unit * 4)  # drawing them on the host takes time too
    note = None
    if samples * per_sample > resident_bytes():
        note = (f"{samples} synthetic samples are {samples * per_sample / 1e9:.2f} GB, over nodescale's "
                f"{resident_bytes() / 1e9:.2f} GB on-device limit: nodescale copies every batch from host memory")
    return samples, note


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--variants", default="auto",
                        help="comma-separated, each PRECISION[+cl][+compile] with PRECISION fp32 or bf16 "
                             "('cl' = channels_last, CNNs only: skipped for ViT); default auto: "
                             + "; ".join(f"{c.name} {', '.join(c.auto_variants)}" for c in CASES.values()))
    parser.add_argument("--quick", action="store_true",
                        help="one eager bf16 variant per model, 1 repeat, 30 steps: a first check (~2 min on a GPU)")
    parser.add_argument("--batch-size", default=None,
                        help="per step, for every case (N) or per case (resnet50=256,vit_b16=128); "
                             "default " + ", ".join(f"{c.name} {c.batch_size}" for c in CASES.values()))
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps per run, warm-up included "
                        "(default 50; 30 with --quick)")
    parser.add_argument("--warmup", type=int, default=10, help="first steps excluded from the timing (default 10)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each side per case and variant, alternating which goes first "
                             "(default 2; 1 with --quick)")
    parser.add_argument("--compile-repeats", type=int, default=1,
                        help="repeats of the compiled variants (default 1: compilation takes a minute or more)")
    parser.add_argument("--samples", type=int, default=None,
                        help="nodescale's data.samples (default: a multiple of 8 x batch that stays on the GPU)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--raw-model-source", choices=("auto", "torchvision", "nodescale"), default="auto",
                        help="who builds the raw side's model (default auto: torchvision if importable); "
                             "nodescale: the same model code on both sides, so only the loops differ")
    parser.add_argument("--no-raw-cudnn-benchmark", dest="raw_cudnn_benchmark", action="store_false",
                        help="leave cudnn.benchmark off on the raw side (nodescale: train.cudnn_benchmark)")
    parser.add_argument("--raw-pool-batches", type=int, default=4, help="distinct batches the raw loop cycles")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of both sides (default: inherit)")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="skip a run that its estimate says would end after this many seconds (default 540)")
    parser.add_argument("--hard-limit-s", type=float, default=585.0,
                        help="kill a run still going this many seconds after the start (default 585)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results JSON (default {DEFAULT_OUT})")
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep every run's log and run dir here")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its time estimate only")
    args = parser.parse_args(argv)
    args.case_names = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = [name for name in args.case_names if name not in CASES]
    if unknown or not args.case_names:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.steps is None:
        args.steps = 30 if args.quick else 50
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    if args.repeats < 1 or args.compile_repeats < 1:
        parser.error("--repeats and --compile-repeats must be at least 1")
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step carries start-up and compilation)")
    if "vit_b16" in args.case_names and args.image_size % VIT_PATCH:
        parser.error(f"vit_b16 needs an --image-size divisible by {VIT_PATCH}")
    try:
        args.batch_sizes = parse_batch_sizes(args.batch_size, args.case_names)
        if args.variants != "auto":
            args.variant_list = [parse_variant(v) for v in args.variants.split(",") if v.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    return args


def build_plan(args: argparse.Namespace) -> tuple[list[Point], list[str]]:
    points: list[Point] = []
    notes: list[str] = []
    for name in args.case_names:
        case = CASES[name]
        if args.variants == "auto":
            variants = [parse_variant(v) for v in (QUICK_VARIANTS[name] if args.quick else case.auto_variants)]
        else:
            variants = []
            for variant in args.variant_list:
                if variant.channels_last and not case.cnn:
                    notes.append(f"{name} {variant.name}: skipped, channels_last applies to CNNs")
                    continue
                variants.append(variant)
        batch = args.batch_sizes[name]
        samples, note = nodescale_samples(batch, args.image_size, args.samples)
        if samples % batch:
            notes.append(f"{name}: --samples {samples} is not a multiple of the batch {batch}: "
                         "nodescale's last batch of each epoch is partial")
        if note:
            notes.append(f"{name}: {note}")
        for variant in variants:
            points.append(Point(name, variant, batch, args.image_size, args.num_classes, args.steps, args.warmup,
                                samples))
    return points, notes


def schedule(points: list[Point], repeats: int, compile_repeats: int) -> list[tuple[int, Point, list[str]]]:
    """(repeat, point, sides in order) in run order: every point once per repeat (compiled variants
    ``compile_repeats`` times), eager variants before compiled ones, so that a short time budget
    still measures every eager variant; which side goes first alternates."""
    ordered = sorted(points, key=lambda p: p.variant.compile)  # stable: case order within each group
    order = []
    for repeat in range(max(repeats, compile_repeats)):
        for index, point in enumerate(ordered):
            if repeat >= (compile_repeats if point.variant.compile else repeats):
                continue
            sides = ["raw", "nodescale"] if (repeat + index) % 2 == 0 else ["nodescale", "raw"]
            order.append((repeat, point, sides))
    return order


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    console = wide_console(230)
    import torch  # after parsing: --help stays fast

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        console.print("[red]--device cuda, but torch sees no CUDA device[/]")
        return 2
    raw_source = args.raw_model_source
    if raw_source == "auto":
        try:
            import torchvision  # noqa: F401

            raw_source = "torchvision"
        except Exception:  # noqa: BLE001
            raw_source = "nodescale"
    points, notes = build_plan(args)
    if not points:
        console.print("[red]nothing to run[/]")
        return 2
    order = schedule(points, args.repeats, args.compile_repeats)
    on_gpu = device == "cuda"
    estimate = sum(guess_seconds(p, side) for _, p, sides in order for side in sides) if on_gpu else None
    console.print(f"throughput: {len(points)} case/variant(s), {args.repeats} repeat(s) of each side "
                  f"({args.compile_repeats} when compiled) = {2 * len(order)} runs on {device}; raw model from "
                  f"{raw_source}; {args.steps} steps, {args.warmup} warm-up")
    for point in points:
        console.print(f"  {point.key:<24} batch {point.batch_size}, {point.image_size} px, nodescale "
                      f"data.samples={point.samples}"
                      + (f", ~{guess_seconds(point, 'raw') + guess_seconds(point, 'nodescale'):.0f} s per pair"
                         if on_gpu else ""))
    for note in notes:
        console.print(f"  note: {note}")
    if estimate is not None:
        compile_guess = f"{GUESS_COMPILE_SECONDS['raw']:.0f}/{GUESS_COMPILE_SECONDS['nodescale']:.0f}"
        console.print(f"estimated {estimate / 60:.1f} min (rough H100 guesses; compile ~{compile_guess} s "
                      f"raw/nodescale); budget {args.budget_s:.0f} s: a pair of runs that would end after it is "
                      "skipped" + (" [yellow](some may be)[/]" if estimate > args.budget_s else ""))
    if args.dry_run:
        return 0

    flops_by_case: dict[str, int | None] = {}
    flops_notes: dict[str, str | None] = {}
    for name in args.case_names:
        flops_by_case[name], flops_notes[name] = training_flops(name, args.image_size, args.num_classes)
    info = machine_info(device)
    runs: list[RunResult] = []
    skipped: list[dict[str, Any]] = []
    observed: dict[tuple[str, str], float] = {}
    reference = reference_row(flops_by_case, args.image_size, args.num_classes)

    def record(final: bool) -> dict[str, Any]:
        fill_machine_from_runs(info, runs)
        summaries = [summarise(p, runs, flops_by_case.get(p.case), flops_notes.get(p.case)) for p in points]
        return {
            **stamp(),
            "benchmark": "throughput",
            "complete": final and not skipped and all(r.ok for r in runs),
            "machine": info,
            "settings": {
                "device": device, "raw_model_source": raw_source, "raw_cudnn_benchmark": args.raw_cudnn_benchmark,
                "raw_pool_batches": args.raw_pool_batches, "repeats": args.repeats,
                "compile_repeats": args.compile_repeats, "steps": args.steps,
                "warmup_steps": args.warmup, "image_size": args.image_size, "num_classes": args.num_classes,
                "omp_num_threads": args.threads if args.threads is not None else os.environ.get("OMP_NUM_THREADS"),
                "budget_s": args.budget_s,
            },
            "units": {
                "images_per_second": "training images per second, warm-up excluded",
                "ratio": "nodescale images/s / raw images/s (medians); 1.0 = parity",
                "mfu": "images/s x training FLOPs per image / peak FLOP/s of the device for the precision (0..1)",
                "training_flops_per_sample": "3 x forward FLOPs (2 per multiply-add, FlopCounterMode)",
                "warmup_seconds": "the first --warmup optimiser steps, compilation and autotuning included",
            },
            "target_ratio": TARGET_RATIO,
            "reference": reference,
            "notes": notes,
            "cases": summaries,
            "runs": [asdict(r) for r in runs],
            "skipped": skipped,
            "total_seconds": time.perf_counter() - started,
        }

    with tempfile.TemporaryDirectory(prefix="nodescale-throughput-") as tmp:
        workdir = args.keep_logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        ctx = Context(device, workdir, child_env(args, device), raw_source, args.raw_cudnn_benchmark,
                      args.raw_pool_batches, started, args.hard_limit_s, Path(tmp) / "compile-cache")
        runners = {"raw": run_raw, "nodescale": run_nodescale}
        for repeat, point, sides in order:
            # A pair runs whole or not at all: one side alone compares nothing.
            elapsed = time.perf_counter() - started
            expected = [observed.get((point.key, side)) or (guess_seconds(point, side) if on_gpu else None)
                        for side in sides]
            needed = sum(e for e in expected if e is not None)
            if elapsed + needed > args.budget_s or ctx.remaining() < 10:
                reason = f"time budget: {elapsed:.0f} s gone, ~{needed:.0f} s more needed, budget {args.budget_s:.0f} s"
                skipped += [{"repeat": repeat, "point": point.key, "side": side, "reason": reason} for side in sides]
                console.print(f"repeat {repeat + 1}  {point.key:<24} skipped ({reason})")
                continue
            for side in sides:
                if ctx.remaining() < 10:
                    skipped.append({"repeat": repeat, "point": point.key, "side": side,
                                    "reason": f"hard limit {args.hard_limit_s:.0f} s nearly reached"})
                    console.print(f"repeat {repeat + 1}  {point.key:<24} {side:<9} skipped (hard limit)")
                    continue
                result = runners[side](point, repeat, ctx)
                runs.append(result)
                observed[(point.key, side)] = max(observed.get((point.key, side), 0.0), result.wall_seconds)
                if result.ok:
                    console.print(
                        f"repeat {repeat + 1}  {point.key:<24} {side:<9} "
                        f"{result.samples_per_second:10,.1f} img/s  {result.step_seconds * 1e3:9.2f} ms/step  "
                        f"warm-up {fmt(result.warmup_seconds, '.1f')} s  (wall {result.wall_seconds:.1f} s)")
                else:
                    console.print(f"[red]repeat {repeat + 1}  {point.key:<24} {side:<9} failed:[/] "
                                  + escape(result.error or ""))
                write_json_atomic(args.out, record(final=False))  # a killed invocation keeps what it measured

    result_record = record(final=True)
    summaries = result_record["cases"]
    console.print(results_table(summaries, reference, device))
    for s in summaries:
        for note in s["notes"]:
            console.print(f"{s['case']} {s['variant']}: {note}")
    if reference is not None:
        best = {side: max((s[f"{side}_images_per_second_median"] or 0.0 for s in summaries if s["case"] == "resnet50"),
                          default=0.0) for side in ("raw", "nodescale")}
        if best["raw"] or best["nodescale"]:
            console.print(f"ResNet-50 best here: raw {best['raw']:,.0f} / nodescale {best['nodescale']:,.0f} img/s = "
                          f"x{best['raw'] / REFERENCE['images_per_second']:.2f} / "
                          f"x{best['nodescale'] / REFERENCE['images_per_second']:.2f} the published A100 AMP figure "
                          f"({REFERENCE['images_per_second']:,.0f} img/s, {REFERENCE['source']})")
    gpu = info.get("gpu") or "unknown device"
    console.print(f"device {gpu}; torch {info['torch_version']}, CUDA {info.get('cuda_version')}, "
                  f"cuDNN {info.get('cudnn_version')}, torchvision {info.get('torchvision_version')}")
    if skipped:
        console.print(f"[yellow]{len(skipped)} run(s) skipped for the time budget (see 'skipped' in the JSON)[/]")
    console.print(f"total time {time.perf_counter() - started:.0f} s")
    write_results(args.out, result_record, console)
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
