"""What a ``throughput.py`` run's figures are and mean: each side's figures read from its output,
the model's training FLOPs, the device's peak, MFU, the summary of each case and variant, the table.

MFU = images/s x training FLOPs per image (tokens/s x per token for a language model, where
``6N + 12LdT`` is shown beside the counter's figure) / the device's peak FLOP/s for the precision, by
``nodescale.bench.scaling_math.mfu`` (as ``nodescale bench scaling``), with the peaks of
``nodescale/bench/peaks.yaml`` (fp32 runs against the TF32 peak: cuDNN runs fp32 convolutions on
TF32 tensor cores). A device not in the table gets MFU "unknown", never a guess.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import compare, nodescale_summary, result_line, span
from rich.table import Table
from throughput_cases import CASES, VIT_PATCH, Point, data_bytes

if TYPE_CHECKING:
    from throughput import Run

TARGET_RATIO = 0.98  # nodescale/raw images per second: overhead.py's 2% on step time
SIDES = ("raw", "nodescale")
REFERENCE = {
    "what": "ResNet-50 v1.5 training, AMP (fp16), one A100 80GB, batch 256",
    "images_per_second": 2470.0,
    "source": "NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5 training performance (DGX A100 80GB, 1 GPU)",
    "device": "NVIDIA A100-SXM4-80GB",
    "peak_dtype": "fp16",
    "note": "published figure, not measured here: real ImageNet data through DALI, fp16 AMP, another GPU",
}

UNITS = {"images_per_second": "training images per second, warm-up excluded",
         "tokens_per_second": "language models: training tokens (next-token predictions) per second, warm-up excluded",
         "ratio": "nodescale/raw images/s or tokens/s (medians); 1.0 = parity",
         "mfu": "images/s x training FLOPs per image (or per token) / the device's peak FLOP/s for the precision",
         "warmup_seconds": "the first --warmup optimiser steps, compilation and autotuning included"}


# ------------------------------------------------------------ each side's figures
def raw_figures(log: Path) -> dict[str, Any]:
    data = result_line(log)
    warmup = data.get("warmup_step_seconds") or []
    return {**data, "warmup_seconds": sum(warmup) if warmup else None}


def nodescale_figures(point: Point, run_dir: Path) -> dict[str, Any]:
    data = nodescale_summary(run_dir)
    keep = ("samples_per_second", "step_seconds", "timed_steps", "timed_samples", "peak_memory_bytes",
            "peak_memory_kind", "data_wait_fraction", "epochs_completed", "global_steps", "state_bytes_per_rank",
            "torch_version", "python_version", "val_loss", "tokens_per_second", "mfu", "training_flops_per_token",
            "estimated_training_flops_per_token")
    return {**{k: data.get(k) for k in keep}, "train_wall_seconds": data.get("wall_seconds"),
            "device_name": data.get("device"), "data_bytes": data_bytes(point),
            "warmup_seconds": nodescale_warmup_seconds(run_dir, point.warmup_steps)}


def nodescale_warmup_seconds(run_dir: Path, warmup_steps: int) -> float | None:
    """Seconds of the first ``warmup_steps`` steps from metrics.jsonl: each ``step`` record covers the
    steps since the one before, so the sum is known only when a record falls on the last warm-up step."""
    total, previous = 0.0, 0
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short
            continue
        if record.get("kind") != "step" or record.get("step_seconds") is None:
            continue
        if int(record["step"]) > warmup_steps:
            return None
        total += float(record["step_seconds"]) * (int(record["step"]) - previous)
        previous = int(record["step"])
        if previous == warmup_steps:
            return total
    return None


# -------------------------------------------------------------- analysis
def peak_flops(device_name: str | None, precision: str) -> dict[str, Any]:
    """The peak FLOP/s an MFU of this precision is measured against, or why there is none."""
    from nodescale.bench import peaks

    entry = peaks.find_peak(device_name)
    dtype = peaks.peak_dtype(precision, entry)
    flops = entry.flops(dtype) if entry is not None else None
    note = (None if flops else "no device reported: MFU unknown" if device_name is None else
            f"no {dtype} peak for {device_name!r} in nodescale/bench/peaks.yaml: MFU unknown")
    return {"device": device_name, "dtype": dtype, "flops": flops, "tflops": flops / 1e12 if flops else None,
            "source": entry.source if entry else None, "note": note}


def training_flops(point: Point) -> tuple[int | None, str | None, int | None]:
    """nodescale's count for the model both sides train, per sample: 3 x forward FLOPs (FlopCounterMode, meta
    device; the engine's counter), the reason where there is none, and a language model's 6N + 12LdT."""
    try:
        import torch

        from nodescale.config.schema import ModelSection
        from nodescale.models.introspect import training_flops_per_sample
        from nodescale.models.registry import build_model
        from nodescale.models.spec import InputSpec

        if point.seq_len is not None:
            section, spec = ModelSection(name=point.case), InputSpec((point.seq_len,), point.num_classes,
                                                                     "language_modeling")
        else:
            section = (ModelSection(name=point.case, stem="imagenet") if CASES[point.case].cnn
                       else ModelSection(name=point.case, patch_size=VIT_PATCH))
            spec = InputSpec((3, point.image_size, point.image_size), point.num_classes)
        with torch.device("meta"):
            model = build_model(section, spec)
            estimate = getattr(model, "estimated_training_flops_per_token", None)
            return (training_flops_per_sample(model, spec), None,
                    estimate(point.seq_len) * point.seq_len if point.seq_len and estimate else None)
    except Exception as exc:  # noqa: BLE001 - the MFU is then unknown, with the reason
        return None, f"FLOPs not counted: {type(exc).__name__}: {exc}", None


def summarise(point: Point, description: str, runs: list[Run], flops: int | None, flops_note: str | None,
              estimated: int | None = None) -> dict[str, Any]:
    """Medians of each side (images/s, or tokens/s), their ratio, MFU, memory and the checks of one case and
    variant; ``flops`` and ``estimated`` (6N + 12LdT) per sample."""
    from nodescale.bench.scaling_math import mfu

    mine = [r for r in runs if r.point == point.key]
    ok = {side: [r for r in mine if r.side == side and r.ok] for side in SIDES}
    unit, per_unit = f"{CASES[point.case].unit}_per_second", point.per_sample  # a sample is an image or seq_len tokens
    unit_flops = flops / per_unit if flops else None
    rates = {side: {r.repeat: r.figures["samples_per_second"] * per_unit for r in ok[side]
                    if r.figures.get("samples_per_second")} for side in SIDES}
    found = compare("raw", rates["raw"], "nodescale", rates["nodescale"], unit, higher_is_better=True)

    def first(side: str, key: str) -> Any:
        return next((r.figures[key] for r in ok[side] if r.figures.get(key)), None)

    def median(side: str, key: str, scale: float = 1.0) -> float | None:
        values = [r.figures[key] * scale for r in ok[side] if r.figures.get(key)]
        return statistics.median(values) if values else None

    def memory(side: str) -> dict[str, Any]:
        top = max((r.figures["peak_memory_bytes"] for r in ok[side] if r.figures.get("peak_memory_bytes")),
                  default=None)
        data, kind = first(side, "data_bytes"), first(side, "peak_memory_kind")
        return {"peak_bytes": top, "kind": kind, "data_bytes": data, "peak_bytes_excluding_data":
                top - data if top is not None and data is not None and kind == "cuda_max_allocated" else None}

    both = ok["raw"] + ok["nodescale"]
    like_for_like = bool(ok["raw"]) and bool(ok["nodescale"]) and len(
        {(r.figures.get("timed_steps"), r.figures.get("timed_samples")) for r in both}) == 1
    peak = peak_flops(next((r.figures["device_name"] for r in both if r.figures.get("device_name")), None),
                      point.variant.precision)
    raw_flops = first("raw", "training_flops_per_sample")
    notes = [n for n in (flops_note, peak["note"]) if n]
    if flops and raw_flops and abs(raw_flops - flops) > 0.01 * flops:
        notes.append(f"the raw model counts {raw_flops:.4g} training FLOPs per sample, nodescale's {flops:.4g}: "
                     "not the same architecture")
    engine = first("nodescale", "training_flops_per_token")  # what the run itself counted (language models)
    if unit_flops and engine and abs(engine - unit_flops) > 0.01 * unit_flops:
        notes.append(f"nodescale's run counted {engine:.4g} FLOPs per token, this harness {unit_flops:.4g}")
    if unit_flops and estimated and abs(estimated / per_unit - unit_flops) > 0.05 * unit_flops:
        notes.append(f"FLOPs per token: the counter's {unit_flops:.4g} and 6N + 12LdT's {estimated / per_unit:.4g} "
                     "differ by more than 5%")
    if any(r.figures.get("graphs_compiled_during_timing") for r in ok["raw"]):
        notes.append("raw: torch.compile compiled a graph inside the timed steps (raise --warmup)")
    if any(r.figures.get("finite_loss") is False for r in ok["raw"]):
        notes.append("raw: the final loss was not finite")
    failed = [r for r in mine if not r.ok]
    if failed:
        notes.append(f"{len(failed)} run(s) failed: see runs[].error in the JSON and the logs")
    ratio = found["ratio"]
    status = ("skipped" if not mine else "failed" if not both else "incomplete" if not all(ok.values())
              else "invalid" if not like_for_like else "pass" if ratio is not None and ratio >= TARGET_RATIO
              else "slower")
    if status == "invalid":
        notes.append("invalid: the two sides timed different numbers of steps or samples")
    medians = {side: found[f"{side}_{unit}_median"] for side in SIDES}
    return {
        "case": point.case, "variant": point.variant.name, "description": description, "unit": unit,
        "config": {**{k: v for k, v in asdict(point).items() if k != "variant"}, **asdict(point.variant)},
        "status": status, **found, "target_ratio": TARGET_RATIO,
        **{f"{side}_step_ms_median": median(side, "step_seconds", 1e3) for side in SIDES},
        "training_flops_per_sample": flops, "raw_training_flops_per_sample": raw_flops,
        **({"training_flops_per_token": unit_flops, "estimated_training_flops_per_token": estimated / per_unit
            if estimated else None, "nodescale_counted_flops_per_token": engine} if point.seq_len else {}),
        "raw_parameters": first("raw", "parameters"), "raw_model_source": first("raw", "model_source"),
        "peak": {k: v for k, v in peak.items() if k != "flops"},
        **{f"{side}_mfu": mfu(medians[side], unit_flops, peak["flops"], 1) for side in SIDES},
        **{f"{side}_achieved_tflops": medians[side] * unit_flops / 1e12 if medians[side] and unit_flops else None
           for side in SIDES},
        **{f"{side}_memory": memory(side) for side in SIDES},
        # The first warm-up steps, compilation and autotuning included (every run compiles cold).
        **{f"{side}_warmup_seconds_max": max((r.figures["warmup_seconds"] for r in ok[side]
                                              if r.figures.get("warmup_seconds") is not None), default=None)
           for side in SIDES},
        **{f"{side}_wall_seconds": [round(r.wall_seconds, 2) for r in ok[side]] for side in SIDES},
        "like_for_like": like_for_like, "failed_runs": len(failed), "notes": notes,
    }


def reference_row(flops: int | None) -> dict[str, Any]:
    """The published A100 figure with its MFU by the same FLOP count."""
    from nodescale.bench.scaling_math import mfu

    peak = peak_flops(REFERENCE["device"], "fp16")["flops"]
    return {**REFERENCE, "training_flops_per_sample": flops, "mfu": mfu(REFERENCE["images_per_second"], flops, peak, 1),
            "peak_tflops": peak / 1e12 if peak else None}


def device_facts(runs: list[Run]) -> dict[str, Any]:
    """The GPU and the versions the sides saw (the harness never initialises CUDA itself)."""
    done = [r for side in SIDES for r in runs if r.side == side and r.ok]
    return {"gpu": next((r.figures.get("device_name") for r in done), None),
            **{key: next((r.figures[key] for r in done if r.figures.get(key)), None)
               for key in ("device_capability", "device_memory_bytes", "cuda_version", "cudnn_version")}}


def against_reference(summaries: list[dict[str, Any]]) -> str:
    """The best ResNet-50 figure of each side as a multiple of the published one ('' without one)."""
    best = {side: max((s[f"{side}_images_per_second_median"] or 0.0 for s in summaries if s["case"] == "resnet50"),
                      default=0.0) for side in SIDES}
    if not any(best.values()):
        return ""
    published = REFERENCE["images_per_second"]
    return (f"ResNet-50 best here: raw {best['raw']:,.0f} / nodescale {best['nodescale']:,.0f} img/s = x"
            + " / x".join(f"{best[side] / published:.2f}" for side in SIDES)
            + f" the published A100 AMP figure ({published:,.0f} img/s, {REFERENCE['source']})")


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    """``value x scale`` formatted, '-' when unknown."""
    return "-" if value is None else format(value * scale, spec)


def results_table(summaries: list[dict[str, Any]], reference: dict[str, Any] | None, device: str) -> Table:
    mem_key = "peak_bytes_excluding_data" if device == "cuda" else "peak_bytes"
    table = Table(title="Training images/s (img) or tokens/s (tok), one device, median of repeats (higher is better); "
                        f"ratio = nodescale/raw, target >= {TARGET_RATIO:.2f}")
    for header in ("case", "variant", "batch", "raw /s", "nodescale /s", "ratio", "paired", "result",
                   "raw MFU", "nodescale MFU", "peak", "raw step ms", "ns step ms",
                   ("peak GB excl. data" if device == "cuda" else "peak host RSS GB") + " raw/ns", "warm-up s raw/ns"):
        table.add_column(header, justify="left" if header in ("case", "variant", "peak") else "right",
                         no_wrap=header in ("case", "variant"))
    colours = {"pass": "green", "slower": "red", "invalid": "red", "failed": "red"}

    def pct(value: float | None) -> str:
        return "unknown" if value is None else f"{value:.1%}"

    for s in summaries:
        tflops = s["peak"].get("tflops")
        table.add_row(
            s["case"], s["variant"], str(s["config"]["batch_size"]),
            *(fmt(s[f"{side}_{s['unit']}_median"], ",.1f") + " " + s["unit"][:3] for side in SIDES),
            fmt(s["ratio"], ".3f"), span(s["paired_ratios"]),
            f"[{colours.get(s['status'], 'yellow')}]{s['status']}[/]", pct(s["raw_mfu"]), pct(s["nodescale_mfu"]),
            f"{s['peak']['dtype']} {tflops:.0f} TF" if tflops else "unknown",
            fmt(s["raw_step_ms_median"], ",.2f"), fmt(s["nodescale_step_ms_median"], ",.2f"),
            " / ".join(fmt(s[f"{side}_memory"][mem_key], ".2f", 1e-9) for side in SIDES),
            " / ".join(fmt(s[f"{side}_warmup_seconds_max"], ".1f") for side in SIDES))
    if reference is not None:
        table.add_row("resnet50", "reference", "256", f"{reference['images_per_second']:,.0f}", "", "", "", "",
                      pct(reference["mfu"]), "", f"fp16 {fmt(reference['peak_tflops'], '.0f')} TF", "", "", "", "",
                      style="dim")
    return table
