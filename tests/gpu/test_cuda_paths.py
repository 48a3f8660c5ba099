"""The GPU fast path on a real CUDA device: NCCL, bf16/fp16, channels_last, torch.compile,
TF32 and cuDNN autotuning, resident and pinned batches, the allocator's memory figures, NVML
samples, CUDA kernels in the profiler, and no host synchronisation inside the training step.

Skipped without CUDA (see conftest.py); ``scripts/gpu-check.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import csv
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import read_summary, run_cli

pytestmark = pytest.mark.gpu


def _train(tmp_path: Path, name: str, *flags: str, timeout: float = 600) -> dict:
    out = tmp_path / name
    run_cli(["train", "--out", str(out), "--set", "checkpoint.at_end=false", *flags], tmp_path, timeout=timeout)
    return read_summary(out)


def _synchronisations(tmp_path: Path, steps: int) -> int:
    """Synchronising CUDA calls of a whole in-process run of ``steps`` optimiser steps."""
    from nodescale.config.load import load_config
    from nodescale.train.run import run_training

    cfg = load_config(overrides={
        "model.name": "cnn", "data.name": "digits", "train.epochs": 1, "train.max_steps": steps,
        "train.batch_size": 16, "train.log_every": 10_000, "checkpoint.at_end": False,
        "out": str(tmp_path / f"steps-{steps}"),
    })
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_training(cfg)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def test_the_training_step_never_waits_for_the_gpu(tmp_path: Path) -> None:
    """Host synchronisations belong to start-up, log points and evaluation, never to each step.

    The same run with 40 steps instead of 10 (one epoch of digits, no log point in between)
    must synchronise exactly as often: any per-step ``.item()``, blocking copy or CPU-indexed
    CUDA tensor would add 30. A first run absorbs the process's one-time CUDA set-up, which
    synchronises once (seen on an H100: 41 for 10 steps first, 40 for 40 steps second).
    """
    _synchronisations(tmp_path / "warm-up", 10)
    short = _synchronisations(tmp_path, 10)
    long = _synchronisations(tmp_path, 40)
    assert long == short, f"{long - short} more synchronisations for 30 more steps ({short} for 10 steps)"


def test_bf16_channels_last_and_compile_train_the_default_job(tmp_path: Path) -> None:
    summary = _train(tmp_path, "fast", "--precision", "bf16", "--channels-last", "--compile", "--epochs", "3")
    assert summary["world_size"] == 1
    assert not summary["device"].startswith("cpu"), summary["device"]  # CUDA's name, e.g. "NVIDIA H100 80GB HBM3"
    assert summary["val_accuracy"] > 0.9, summary
    assert summary["peak_memory_kind"] == "cuda_max_allocated"
    assert 0 < summary["peak_memory_bytes"] < torch.cuda.get_device_properties(0).total_memory


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_other_precisions_train(tmp_path: Path, precision: str) -> None:
    summary = _train(tmp_path, precision, "--precision", precision, "--epochs", "3")
    assert summary["val_accuracy"] > 0.9, summary


def test_resnet_and_vit_train_a_few_steps_in_bf16(tmp_path: Path) -> None:
    for model in ("resnet50", "vit_b16"):
        summary = _train(tmp_path, model, "--model", model, "--dataset", "synthetic", "--set", "data.image_size=224",
                         "--set", "data.samples=256", "--batch-size", "32", "--max-steps", "6", "--precision",
                         "bf16", "--channels-last")
        assert summary["global_steps"] == 6
        assert summary["samples_per_second"] > 0


def test_fsdp_on_one_gpu_with_nccl(tmp_path: Path) -> None:
    summary = _train(tmp_path, "fsdp", "--strategy", "fsdp", "--nproc", "1", "--precision", "bf16", "--epochs", "2")
    assert summary["backend"] == "nccl"
    assert summary["val_accuracy"] > 0.8, summary


def test_bench_comm_on_nccl(tmp_path: Path) -> None:
    out = tmp_path / "comm"
    run_cli(["bench", "comm", "--nproc", "1", "--sizes", "1K:16M", "--out", str(out), "--no-plot"], tmp_path)
    rows = json.loads((out / "results.json").read_text())
    assert rows and all(row["correct"] for row in rows)
    assert {row["backend"] for row in rows} == {"nccl"}
    assert all(row["device"].startswith("cuda") for row in rows)


def test_monitor_samples_the_gpu_through_nvml(tmp_path: Path) -> None:
    _train(tmp_path, "monitored", "--monitor", "--monitor-interval", "0.2", "--epochs", "3")
    with (tmp_path / "monitored" / "monitor" / "node-0.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rows
    assert "gpu0_mem_used_bytes" in rows[0]
    assert any(float(row["gpu0_mem_used_bytes"] or 0) > 0 for row in rows)


def test_profiler_records_cuda_kernels(tmp_path: Path) -> None:
    _train(tmp_path, "profiled", "--profile", "3:2", "--epochs", "1")
    trace = json.loads((tmp_path / "profiled" / "profile" / "rank0.trace.json").read_text())
    categories = {event.get("cat") for event in trace["traceEvents"]}
    assert "kernel" in categories, sorted(c for c in categories if c)


@pytest.fixture
def restored_math_flags() -> Iterator[None]:
    """In-process runs set process-wide flags: put them back for the tests after."""
    benchmark, cudnn_tf32, matmul_precision = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
                                               torch.get_float32_matmul_precision())
    yield
    torch.backends.cudnn.benchmark = benchmark
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    torch.set_float32_matmul_precision(matmul_precision)


def _math_flags_after_run(tmp_path: Path, name: str, *flags: str) -> tuple[bool, bool, bool]:
    """matmul TF32, cuDNN TF32 and cuDNN autotuning as a whole in-process run of ``flags`` left them."""
    from nodescale.cli.main import build_parser
    from nodescale.cli.run_flags import resolve_config
    from nodescale.train.run import run_training

    args = build_parser().parse_args([
        "train", "--model", "cnn", "--dataset", "digits", "--epochs", "1", "--max-steps", "3", "--batch-size", "16",
        "--no-progress", "--set", "checkpoint.at_end=false", "--out", str(tmp_path / name), *flags,
    ])
    run_training(resolve_config(args))
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)


def test_tf32_and_cudnn_benchmark_reach_the_worker(tmp_path: Path, restored_math_flags: None) -> None:
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("highest")
    assert _math_flags_after_run(tmp_path, "tf32", "--tf32") == (True, True, True)
    assert _math_flags_after_run(tmp_path, "strict", "--set", "train.tf32=false",
                                 "--set", "train.cudnn_benchmark=false") == (False, False, False)


def _loader(dataset, plan, device, channels_last=False):  # noqa: ANN001, ANN202
    from nodescale.data.epoch_loader import EpochLoader

    return EpochLoader(dataset, plan, pad=True, drop_last=False, grad_accum=1, device=device,
                       channels_last=channels_last)


def test_resident_channels_last_batches_are_cut_without_a_copy() -> None:
    from nodescale.data.arrays import ArrayDataset
    from nodescale.data.sharding import ShardPlan

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    dataset = ArrayDataset(torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8), torch.arange(64) % 10,
                           scale=255.0, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    plan = ShardPlan(len(dataset), 1, 0, 16, seed=0, shuffle=True)
    loader = _loader(dataset, plan, cuda, channels_last=True)
    resident = loader.dataset
    assert isinstance(resident, ArrayDataset) and resident.x.is_cuda
    assert resident.x.is_contiguous(memory_format=torch.channels_last)
    for (x, _), step in zip(loader, plan.batches(0), strict=True):
        assert x.is_cuda and x.is_contiguous(memory_format=torch.channels_last)
        assert loader._shaped([x])[0].data_ptr() == x.data_ptr()
        torch.testing.assert_close(x.cpu(), dataset.get_batch(step.indices, cpu)[0])


def test_host_batches_reach_the_gpu_intact(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dataset too big to be resident: batches are cut on the host, pinned and copied without blocking."""
    from nodescale.data import epoch_loader
    from nodescale.data.arrays import ArrayDataset
    from nodescale.data.sharding import ShardPlan

    monkeypatch.setattr(epoch_loader, "RESIDENT_BYTES", 0)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    dataset = ArrayDataset(torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8), torch.arange(64) % 10,
                           scale=255.0, mean=(0.5,), std=(0.25,))
    plan = ShardPlan(len(dataset), 1, 0, 16, seed=0, shuffle=True)
    loader = _loader(dataset, plan, cuda)
    assert loader.dataset.x.device == cpu
    for (x, y), step in zip(loader, plan.batches(0), strict=True):
        assert x.is_cuda and y.is_cuda
        expected_x, expected_y = dataset.get_batch(step.indices, cpu)
        torch.testing.assert_close(x.cpu(), expected_x)
        assert torch.equal(y.cpu(), expected_y)


def test_host_batches_are_pinned_before_the_copy() -> None:
    """The profiler names each host-to-device copy by its source memory: pinned, or pageable (which blocks)."""
    from torch.profiler import ProfilerActivity, profile

    from nodescale.data.arrays import ArrayDataset

    dataset = ArrayDataset(torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8), torch.arange(64) % 10,
                           scale=255.0)
    indices = torch.tensor([3, 1, 2, 40])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        x, y = dataset.get_batch(indices, torch.device("cuda"))
        torch.cuda.synchronize()
    copies = [event.name for event in prof.events() if event.name.startswith("Memcpy HtoD")]
    assert sum("Pinned" in name for name in copies) >= 2, copies  # the inputs and the labels
    assert x.is_cuda and y.is_cuda
    expected_x, expected_y = dataset.get_batch(indices, torch.device("cpu"))
    torch.testing.assert_close(x.cpu(), expected_x)
    assert torch.equal(y.cpu(), expected_y)

