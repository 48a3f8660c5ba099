"""The best single-GPU training loop written by hand: the baseline of ``throughput.py``.

Plain PyTorch, as one would write it to get the most images per second out of one GPU::

    python benchmarks/raw_throughput.py --model resnet50 --batch-size 256 --precision bf16 --channels-last
    python benchmarks/raw_throughput.py --model vit_b16 --batch-size 128 --precision bf16 --compile

What it does, and why each choice is the fast one:

* **Model**: torchvision's ``resnet50()`` / ``vit_b_16()`` (no weights), the reference
  implementations. Without torchvision (``--model-source nodescale``, the default when it is
  not installed) the same architecture comes from nodescale's builders, with the ImageNet stem
  and 16-pixel patches at every image size, as ``throughput.py`` asks of nodescale too.
* **Data**: ``--pool-batches`` batches of standard-normal float32 images (what nodescale's
  ``synthetic`` dataset draws: already normalised) and random labels, made once, on the
  device, already in the memory format the model wants: nothing per step but indexing a
  Python list.
* **Step**: ``channels_last`` model and inputs (``--channels-last``), bf16 autocast around
  forward and loss (``--precision bf16``; the loss in float32, as autocast does for
  cross-entropy), optionally ``torch.compile`` (``--compile``, the model only, as nodescale
  compiles it), fused AdamW (nodescale's default optimiser, with its default lr 3e-3 and
  weight decay 0; ``fused=True`` on CUDA), ``zero_grad(set_to_none=True)``,
  ``cudnn.benchmark`` on (``--no-cudnn-benchmark`` to turn off). Numerics otherwise stay at
  torch's defaults (TF32 for cuDNN convolutions on, for matmuls off), as in nodescale.
* **Timing**: the first ``--warmup-steps`` steps (compilation, cuDNN autotuning, allocator
  warm-up) are timed one by one with a synchronisation each and reported, but excluded. The
  steady state is timed with CUDA events recorded before the first and after the last timed
  step, with no host synchronisation in between (the host clock around it is reported too).
  On the CPU, ``time.perf_counter``.

It prints one JSON line prefixed ``RESULT`` and, with ``--json-out``, writes
the same object to a file. It imports nothing from nodescale unless the model comes from
nodescale.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

RESULT_PREFIX = "RESULT "
MODELS = ("resnet50", "vit_b16")
CNN_MODELS = ("resnet50",)
TORCHVISION_NAMES = {"resnet50": "resnet50", "vit_b16": "vit_b_16"}
VIT_PATCH = 16


def torchvision_available() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as absent
        return False
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="resnet50")
    parser.add_argument("--model-source", choices=("auto", "torchvision", "nodescale"), default="auto",
                        help="who builds the model (default auto: torchvision when importable, else nodescale)")
    parser.add_argument("--image-size", type=int, default=224, help="side of the square images")
    parser.add_argument("--channels", type=int, default=3, help="image channels")
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50, help="optimiser steps in total, warm-up included")
    parser.add_argument("--warmup-steps", type=int, default=10, help="first steps excluded from the timing")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--channels-last", action="store_true", help="channels_last model and inputs")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile mode (default: torch's default mode, as nodescale)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate, constant (nodescale's default)")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--no-cudnn-benchmark", dest="cudnn_benchmark", action="store_false",
                        help="leave torch.backends.cudnn.benchmark off (torch's default; nodescale turns it on)")
    parser.add_argument("--pool-batches", type=int, default=4, help="distinct synthetic batches cycled through")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup_steps:
        parser.error(f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps})")
    if args.batch_size < 1 or args.pool_batches < 1 or args.image_size < 1:
        parser.error("--batch-size, --pool-batches and --image-size must be at least 1")
    if args.model == "vit_b16" and args.image_size % VIT_PATCH:
        parser.error(f"vit_b16 needs an image size divisible by {VIT_PATCH}, not {args.image_size}")
    if args.model_source == "auto":
        args.model_source = "torchvision" if torchvision_available() else "nodescale"
    return args


# ------------------------------------------------------------------ model
def build_model(name: str, source: str, channels: int, image_size: int, num_classes: int) -> nn.Module:
    if source == "torchvision":
        import torchvision

        if channels != 3:
            raise SystemExit("torchvision's models take 3-channel images; use --model-source nodescale")
        builder = getattr(torchvision.models, TORCHVISION_NAMES[name])
        if name == "vit_b16":
            return builder(weights=None, image_size=image_size, num_classes=num_classes)
        return builder(weights=None, num_classes=num_classes)
    # The same architecture from nodescale, pinned to what torchvision builds at any size:
    # the ImageNet stem (auto would pick the CIFAR stem up to 64 px) and 16-pixel patches.
    from nodescale.config.schema import ModelSection
    from nodescale.models.registry import build_model as build_nodescale
    from nodescale.models.spec import InputSpec

    section = ModelSection(name=name, stem="imagenet") if name in CNN_MODELS else ModelSection(
        name=name, patch_size=VIT_PATCH)
    return build_nodescale(section, InputSpec((channels, image_size, image_size), num_classes))


def forward_flops_per_sample(model: nn.Module, sample_shape: tuple[int, ...]) -> int | None:
    """FLOPs of one sample's forward pass (2 per multiply-add), counted by FlopCounterMode on a meta copy.

    The same convention as nodescale's ``models.introspect``: matmuls, convolutions and attention
    only, the model in eval mode. A cross-check that both sides train the same model.
    """
    try:
        from torch.utils.flop_counter import FlopCounterMode

        memo: dict[int, Any] = {}
        for param in model.parameters():
            memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
        for buffer in model.buffers():
            memo[id(buffer)] = torch.empty_like(buffer, device="meta")
        meta_model = copy.deepcopy(model, memo).eval()
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            meta_model(torch.empty((1, *sample_shape), device="meta"))
        return int(counter.get_total_flops())
    except Exception as exc:  # noqa: BLE001 - a diagnostic only: never fail the benchmark for it
        print(f"raw_throughput: FLOPs not counted ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


# ----------------------------------------------------------------- device
def pick_device(text: str) -> torch.device:
    if text == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """The same figure nodescale's summary reports: CUDA max allocated, or the host's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (rss if sys.platform == "darwin" else rss * 1024), "host_peak_rss"


def unique_graphs() -> int | None:
    """Graphs torch.compile has compiled so far in this process (None where the counter is not there)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - private API, diagnostics only
        return None


def versions(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python_version": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    try:
        import torchvision

        info["torchvision_version"] = torchvision.__version__
    except Exception:  # noqa: BLE001
        info["torchvision_version"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update({
            "device_name": torch.cuda.get_device_name(device),
            "device_capability": f"{props.major}.{props.minor}",
            "device_memory_bytes": props.total_memory,
            "device_multiprocessors": props.multi_processor_count,
        })
    else:
        info["device_name"] = f"cpu ({platform.processor() or platform.machine()})"
    return info


# ------------------------------------------------------------------- main
def make_optimizer(args: argparse.Namespace, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    fused = {"fused": True} if device.type == "cuda" else {}  # one multi-tensor kernel set per step
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay, **fused)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, **fused)


def make_pool(args: argparse.Namespace, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The synthetic batches, on the device, in the model's memory format, made once."""
    generator = torch.Generator(device=device).manual_seed(args.seed)
    shape = (args.batch_size, args.channels, args.image_size, args.image_size)
    pool = []
    for _ in range(args.pool_batches):
        x = torch.randn(shape, device=device, generator=generator, dtype=torch.float32)
        if args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, args.num_classes, (args.batch_size,), device=device, generator=generator)
        pool.append((x, y))
    return pool


def main(argv: list[str] | None = None) -> int:
    began = time.perf_counter()
    args = parse_args(argv)
    device = pick_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.manual_seed(args.seed)

    sample_shape = (args.channels, args.image_size, args.image_size)
    model = build_model(args.model, args.model_source, args.channels, args.image_size, args.num_classes)
    params = sum(p.numel() for p in model.parameters())
    forward_flops = forward_flops_per_sample(model, sample_shape)
    model = model.to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(args, model, device)
    runner: Callable[[torch.Tensor], torch.Tensor] = (
        torch.compile(model, mode=args.compile_mode) if args.compile else model)
    autocast: AbstractContextManager[Any] = (
        torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext())
    pool = make_pool(args, device)
    data_bytes = sum(x.numel() * x.element_size() + y.numel() * y.element_size() for x, y in pool)
    model.train()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast:
            loss = F.cross_entropy(runner(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    # Warm-up: compilation, autotuning, the allocator's first blocks. Each step timed on its own.
    sync(device)
    setup_seconds = time.perf_counter() - began
    warmup_step_seconds = []
    for index in range(args.warmup_steps):
        started = time.perf_counter()
        step(*pool[index % len(pool)])
        sync(device)
        warmup_step_seconds.append(time.perf_counter() - started)

    # Steady state: no host synchronisation between the two events.
    timed_steps = args.steps - args.warmup_steps
    graphs_before = unique_graphs()
    use_events = device.type == "cuda"
    if use_events:
        start_event = torch.cuda.Event(enable_timing=True)
        end_event = torch.cuda.Event(enable_timing=True)
    sync(device)
    host_started = time.perf_counter()
    if use_events:
        start_event.record()
    loss = None
    for index in range(timed_steps):
        loss = step(*pool[(args.warmup_steps + index) % len(pool)])
    if use_events:
        end_event.record()
    sync(device)
    host_seconds = time.perf_counter() - host_started
    timed_seconds = start_event.elapsed_time(end_event) / 1e3 if use_events else host_seconds
    graphs_after = unique_graphs()

    final_loss = float(loss.item()) if loss is not None else None  # after the clock: the only read
    memory, memory_kind = peak_memory(device)
    timed_samples = timed_steps * args.batch_size
    result: dict[str, Any] = {
        "model": args.model,
        "model_source": args.model_source,
        "parameters": params,
        "image_size": args.image_size,
        "channels": args.channels,
        "num_classes": args.num_classes,
        "batch_size": args.batch_size,
        "precision": args.precision,
        "channels_last": args.channels_last,
        "compile": args.compile,
        "compile_mode": args.compile_mode,
        "optimizer": args.optimizer,
        "fused_optimizer": device.type == "cuda",
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "pool_batches": args.pool_batches,
        "steps": args.steps,
        "timing_warmup_steps": args.warmup_steps,
        "timed_steps": timed_steps,
        "timed_samples": timed_samples,
        "timing": "cuda_events" if use_events else "perf_counter",
        "timed_seconds": timed_seconds,
        "host_timed_seconds": host_seconds,
        "step_seconds": timed_seconds / timed_steps,
        "samples_per_second": timed_samples / timed_seconds if timed_seconds > 0 else None,
        "setup_seconds": setup_seconds,
        "warmup_step_seconds": [round(s, 6) for s in warmup_step_seconds],
        "first_step_seconds": warmup_step_seconds[0] if warmup_step_seconds else None,
        "graphs_compiled_during_timing": (None if graphs_before is None or graphs_after is None
                                          else graphs_after - graphs_before),
        "final_loss": final_loss,
        "finite_loss": final_loss is not None and math.isfinite(final_loss),
        "peak_memory_bytes": memory,
        "peak_memory_kind": memory_kind,
        "data_bytes": data_bytes,
        "forward_flops_per_sample": forward_flops,
        "training_flops_per_sample": None if forward_flops is None else 3 * forward_flops,
        "device": str(device),
        **versions(device),
        "wall_seconds": time.perf_counter() - began,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
