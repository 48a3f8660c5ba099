"""CpuSyncBatchNorm on 2 real gloo ranks against plain BatchNorm on the whole batch in one process.

One launch of 2 spawned processes checks every case (a launch costs 2-4 s on 2 cores). Each
rank gets its slice of a fixed batch; the forward output, the input gradient, the gradients of
every weight (summed over ranks: each rank holds its share of the gradient of the global loss,
which DDP would average), the running statistics after two steps and the eval-mode output must
match BatchNorm on the whole batch within atol 1e-5 / rtol 1e-4 (float32; the two computations
sum in different orders).
"""

from __future__ import annotations

import copy
import gc
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from nodescale.distributed.sync_batchnorm import CpuSyncBatchNorm, convert_sync_batchnorm

TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}
WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 120


def _model_2d() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),  # a bias before BatchNorm has no effect
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 2, 1, bias=False),
        nn.BatchNorm2d(2, momentum=None),  # cumulative average of the running statistics
    )


class _Model1d(nn.Module):
    """BatchNorm1d on (N, C, L) and on (N, C) inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, bias=False)
        self.bn_seq = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4 * 6, 5, bias=False)
        self.bn_flat = nn.BatchNorm1d(5, momentum=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn_flat(self.fc(torch.relu(self.bn_seq(self.conv(x))).flatten(1)))


def _model_3d() -> nn.Module:
    return nn.Sequential(nn.Conv3d(2, 3, 1, bias=False), nn.BatchNorm3d(3, affine=False))


# name -> (model factory, input shape per sample, samples per rank; uneven on purpose for 1d)
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], list[int]]] = {
    "2d": (_model_2d, (3, 5, 5), [4, 4]),
    "1d": (_Model1d, (3, 8), [3, 5]),
    "3d": (_model_3d, (2, 3, 3, 3), [2, 2]),
}


def _batch(case: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch and the loss weights for one step, the same in every process."""
    make_model, sample_shape, split = CASES[case]
    generator = torch.Generator().manual_seed(1000 * step + len(case))
    # An offset mean makes the two-pass variance matter.
    x = torch.randn(sum(split), *sample_shape, generator=generator) * 2 + 3
    with torch.no_grad():
        out_shape = make_model()(x).shape
    weights = torch.randn(out_shape, generator=generator)
    return x, weights


def _rank_slice(case: str, rank: int) -> slice:
    split = CASES[case][2]
    start = sum(split[:rank])
    return slice(start, start + split[rank])


def _sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    total = tensor.clone()
    dist.all_reduce(total)
    return total


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    failures: list[str] = []
    checked = 0

    def check(label: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        nonlocal checked
        checked += 1
        try:
            torch.testing.assert_close(actual, expected, **TOLERANCE)
        except AssertionError as exc:
            failures.append(f"rank {rank} {case} {label}: {exc}")

    for case, (make_model, _, _) in CASES.items():
        torch.manual_seed(0)
        reference = make_model()
        synced = convert_sync_batchnorm(copy.deepcopy(reference), "cpu")
        local_only = copy.deepcopy(reference)  # plain BatchNorm on this rank's slice: must differ
        kinds = {type(m) for m in synced.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
        if kinds != {CpuSyncBatchNorm}:
            failures.append(f"rank {rank} {case}: BatchNorm layers after conversion: {kinds}")
        part = _rank_slice(case, rank)
        for step in range(2):
            x, weights = _batch(case, step)
            x_full = x.clone().requires_grad_()
            expected = reference(x_full)
            (expected * weights).sum().backward()
            x_part = x[part].clone().requires_grad_()
            out = synced(x_part)
            (out * weights[part]).sum().backward()
            check(f"step {step} output", out, expected[part].detach())
            check(f"step {step} input grad", x_part.grad, x_full.grad[part])
            # Each rank holds its share of the gradient of the global loss (DDP then averages).
            pairs = zip(synced.named_parameters(), reference.parameters(), strict=True)
            for (name, param), ref_param in pairs:
                check(f"step {step} grad of {name}", _sum_over_ranks(param.grad), ref_param.grad)
            with torch.no_grad():
                if torch.allclose(local_only(x[part]), expected[part], atol=1e-3):
                    failures.append(f"rank {rank} {case}: local statistics equal global ones: vacuous test")
            synced.zero_grad()
            reference.zero_grad()
        for (name, buffer), ref_buffer in zip(synced.named_buffers(), reference.buffers(), strict=True):
            check(f"buffer {name}", buffer.float(), ref_buffer.float())
        # Eval mode normalises with the running statistics, like plain BatchNorm.
        synced.eval()
        reference.eval()
        x, _ = _batch(case, 2)
        with torch.no_grad():
            check("eval output", synced(x[part]), reference(x[part]))
        del reference, synced, local_only

    # bfloat16 activations: statistics are reduced in float32, the output keeps bfloat16.
    case = "bf16"
    x, _ = _batch("2d", 0)
    x = x.bfloat16()
    torch.manual_seed(0)
    reference = nn.BatchNorm2d(3)
    synced = convert_sync_batchnorm(copy.deepcopy(reference), "cpu").bfloat16()
    out = synced(x[_rank_slice("2d", rank)])
    if out.dtype != torch.bfloat16:
        failures.append(f"rank {rank} bf16: output dtype {out.dtype}")
    expected = reference(x.float())[_rank_slice("2d", rank)]
    checked += 1
    if not torch.allclose(out.float(), expected, atol=3e-2, rtol=1e-2):
        failures.append(f"rank {rank} bf16: max error {(out.float() - expected).abs().max():.3g}")
    del reference, synced

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"failures": failures, "checked": checked}))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.multiproc
def test_two_gloo_ranks_match_batchnorm_on_the_whole_batch(tmp_path: Path) -> None:
    context = mp.start_processes(
        _worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD_SIZE, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not context.join(timeout=1):  # raises if a rank fails or exits non-zero
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"ranks did not finish within {LAUNCH_TIMEOUT_S} s")
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    failures = [failure for report in reports for failure in report["failures"]]
    assert not failures, "\n".join(failures)
    assert all(report["checked"] > 50 for report in reports)


# --- single process: exactly BatchNorm --------------------------------------------------------


@pytest.mark.parametrize(
    ("norm", "shape"),
    [(nn.BatchNorm1d, (6, 3)), (nn.BatchNorm1d, (6, 3, 4)), (nn.BatchNorm2d, (6, 3, 4, 4)),
     (nn.BatchNorm3d, (6, 3, 2, 2, 2))],
)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"momentum": None},
        {"affine": False},
        {"track_running_stats": False},
        {"eps": 1e-3, "momentum": 0.5},
    ],
)
def test_without_a_process_group_it_is_exactly_batchnorm(
    norm: type, shape: tuple[int, ...], options: dict
) -> None:
    torch.manual_seed(0)
    plain = norm(3, **options)
    if plain.affine:
        with torch.no_grad():
            plain.weight.uniform_(0.5, 1.5)
            plain.bias.uniform_(-0.5, 0.5)
    synced = convert_sync_batchnorm(copy.deepcopy(plain), "cpu")
    assert isinstance(synced, CpuSyncBatchNorm)
    for step in range(3):
        x = torch.randn(shape) * 3 + 1
        if step == 2:
            plain.eval()
            synced.eval()
        x_plain, x_sync = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_plain, out_sync = plain(x_plain), synced(x_sync)
        assert torch.equal(out_plain, out_sync)
        out_plain.square().sum().backward()
        out_sync.square().sum().backward()
        assert torch.equal(x_plain.grad, x_sync.grad)
    for a, b in zip(plain.parameters(), synced.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    for a, b in zip(plain.buffers(), synced.buffers(), strict=True):
        assert torch.equal(a, b)


def test_convert_carries_everything_over() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-3, momentum=0.2), nn.Flatten(), nn.BatchNorm1d(4 * 36),
        nn.Sequential(nn.BatchNorm3d(2, affine=False, track_running_stats=False)),
    )
    with torch.no_grad():
        model[1].running_mean.fill_(0.25)
        model[1].num_batches_tracked.fill_(7)
    model[1].weight.requires_grad_(False)
    model[3].eval()
    old = {name: module for name, module in model.named_modules()}

    converted = convert_sync_batchnorm(model, "cpu")

    assert converted is model
    assert isinstance(model[0], nn.Conv2d) and model[0] is old["0"]
    for name in ("1", "3", "4.0"):
        new, before = model.get_submodule(name), old[name]
        assert isinstance(new, CpuSyncBatchNorm), name
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats", "training"):
            assert getattr(new, attr) == getattr(before, attr), (name, attr)
        assert new.weight is before.weight and new.bias is before.bias
        assert new.running_mean is before.running_mean and new.running_var is before.running_var
        assert new.num_batches_tracked is before.num_batches_tracked
    assert model[1].weight.requires_grad is False and model[1].bias.requires_grad is True
    assert int(model[1].num_batches_tracked) == 7 and float(model[1].running_mean[0]) == 0.25
    assert model[4][0].running_mean is None
    assert isinstance(convert_sync_batchnorm(nn.BatchNorm2d(3), "cpu"), CpuSyncBatchNorm)


def test_convert_on_cuda_delegates_to_torch() -> None:
    # Conversion itself needs no GPU; torch's SyncBatchNorm only refuses CPU tensors when run.
    model = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), "cuda")
    assert type(model[1]) is nn.SyncBatchNorm


def test_rejects_inputs_batchnorm_cannot_take() -> None:
    with pytest.raises(ValueError, match="2D to 5D"):
        CpuSyncBatchNorm(3)(torch.randn(3))
