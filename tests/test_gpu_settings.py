"""The GPU hot-path settings, checked on the CPU: normalisation skipped where it is the identity,
channels_last stored once for resident datasets, cuDNN autotuning and TF32.

On a CUDA device these run for real in tests/gpu/test_cuda_paths.py, which also checks that host batches
are pinned (that needs a real device: nothing here fakes the copy).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import yaml

from nodescale.cli.main import main
from nodescale.config.load import load_config
from nodescale.config.schema import TrainSection
from nodescale.data.arrays import ArrayDataset
from nodescale.data.epoch_loader import EpochLoader
from nodescale.data.sharding import ShardPlan
from nodescale.errors import UserError
from nodescale.train.math_settings import configure_math

CPU = torch.device("cpu")


def _formula(dataset: ArrayDataset, indices: torch.Tensor) -> torch.Tensor:
    """``(x / scale - mean) / std``, written out."""
    x = dataset.x[indices].float() / dataset.scale
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return (x - torch.tensor(dataset.mean).view(shape)) / torch.tensor(dataset.std).view(shape)


def _images(dtype: torch.dtype = torch.uint8, n: int = 40, channels: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n, channels, 6, 5), generator=generator, dtype=torch.uint8)
    return torch.randn(n, channels, 6, 5, generator=generator)


def _labels(n: int = 40) -> torch.Tensor:
    return torch.arange(n) % 10


# --- normalisation ---------------------------------------------------------------------------


def test_mean_0_std_1_batches_equal_the_formula_without_computing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _images(torch.float32)
    x[0, 0, 0, 0] = -0.0
    dataset = ArrayDataset(x, _labels(), mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    indices = torch.tensor([0, 7, 3, 3, 39])
    expected = _formula(dataset, indices)

    def no_stats(*args: object) -> None:
        raise AssertionError("the identity normalisation subtracted and divided anyway")

    monkeypatch.setattr(dataset, "_stats_for", no_stats)
    batch, labels = dataset.get_batch(indices, CPU)
    assert torch.equal(batch, expected)
    assert torch.equal(batch.view(-1).signbit(), expected.view(-1).signbit())  # even -0.0 is kept
    assert batch.dtype == torch.float32
    assert torch.equal(labels, _labels()[indices])
    # The batch is a new tensor: a training step writing into it cannot touch the dataset.
    assert batch.data_ptr() != dataset.x.data_ptr()


def test_mean_0_std_1_still_divides_by_the_scale() -> None:
    dataset = ArrayDataset(_images(), _labels(), scale=255.0)
    indices = torch.arange(40)
    batch, _ = dataset.get_batch(indices, CPU)
    assert torch.equal(batch, _formula(dataset, indices))
    assert batch.max() <= 1.0 and batch.max() > 0.9


@pytest.mark.parametrize(
    "scale, mean, std",
    [
        (255.0, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)),  # per channel, 8-bit pixels
        (1.0, (0.1,), (1.0,)),  # a mean alone
        (1.0, (0.0,), (2.0,)),  # a std alone
        (16.0, (0.0, 0.0, 0.5), (1.0, 1.0, 1.0)),  # one channel off the identity
    ],
)
def test_other_statistics_are_applied_as_before(scale: float, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
    x = _images() if scale != 1.0 else _images(torch.float32)
    dataset = ArrayDataset(x, _labels(), scale=scale, mean=mean, std=std)
    indices = torch.tensor([5, 1, 30, 12])
    batch, _ = dataset.get_batch(indices, CPU)
    assert torch.equal(batch, _formula(dataset, indices))
    assert not torch.equal(batch, dataset.x[indices].float() / scale)


# --- channels_last, stored once --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
@pytest.mark.parametrize("channels", [1, 3])
def test_a_channels_last_store_gives_channels_last_batches_without_a_copy(dtype: torch.dtype, channels: int) -> None:
    plain = ArrayDataset(_images(dtype, channels=channels), _labels(), scale=255.0 if dtype == torch.uint8 else 1.0,
                         mean=(0.5,) * channels, std=(0.25,) * channels)
    stored = plain.to(CPU, channels_last=True)
    assert stored.x.is_contiguous(memory_format=torch.channels_last)
    if channels > 1:  # with one channel both layouts are the same strides
        assert not stored.x.is_contiguous()

    plan = ShardPlan(len(plain), 1, 0, 16, seed=0, shuffle=True)
    loader = _loader(stored, plan, CPU)
    for step, (x, _) in zip(plan.batches(0), loader, strict=True):
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert loader._shaped([x])[0].data_ptr() == x.data_ptr()  # the safety-net conversion copies nothing
        assert torch.equal(x, plain.get_batch(step.indices, CPU)[0])  # the same numbers


def test_a_plain_store_is_still_converted_per_batch() -> None:
    dataset = ArrayDataset(_images(), _labels(), scale=255.0)
    assert dataset.to(CPU).x.is_contiguous()
    plan = ShardPlan(len(dataset), 1, 0, 16, seed=0, shuffle=False)
    x, _ = dataset.get_batch(plan.batches(0)[0].indices, CPU)
    converted = _loader(dataset, plan, CPU)._shaped([x])[0]
    assert converted.is_contiguous(memory_format=torch.channels_last)
    assert converted.data_ptr() != x.data_ptr()
    first, _ = next(iter(_loader(dataset, plan, CPU)))
    assert first.is_contiguous(memory_format=torch.channels_last) and torch.equal(first, x)


def _loader(dataset: ArrayDataset, plan: ShardPlan, device: torch.device, channels_last: bool = True) -> EpochLoader:
    return EpochLoader(dataset, plan, pad=True, drop_last=False, grad_accum=1, device=device,
                       channels_last=channels_last)


def test_a_resident_dataset_is_stored_channels_last_once() -> None:
    # The resident branch runs for any device but the CPU; the meta device keeps layouts without data.
    meta = torch.device("meta")
    dataset = ArrayDataset(_images(), _labels(), scale=255.0)
    plan = ShardPlan(len(dataset), 1, 0, 16)
    resident = _loader(dataset, plan, meta).dataset
    assert isinstance(resident, ArrayDataset) and resident.x.device.type == "meta"
    assert resident.x.is_contiguous(memory_format=torch.channels_last)
    assert _loader(dataset, plan, meta, channels_last=False).dataset.x.is_contiguous()
    vectors = ArrayDataset(torch.randn(40, 7), _labels())  # only 4-D inputs have a channels_last layout
    assert _loader(vectors, plan, meta).dataset.x.is_contiguous()


# --- cuDNN autotuning and TF32 ---------------------------------------------------------------


def _math_flags() -> tuple[object, ...]:
    return (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
            torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())


@pytest.fixture
def restored_math_flags() -> Iterator[None]:
    autotune, cudnn_tf32, _, matmul_precision = _math_flags()
    yield
    torch.backends.cudnn.benchmark = autotune
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    torch.set_float32_matmul_precision(matmul_precision)


@pytest.mark.parametrize("tf32", [None, True, False])
@pytest.mark.parametrize("autotune", [True, False])
def test_configure_math_leaves_the_cpu_alone(restored_math_flags: None, tf32: bool | None, autotune: bool) -> None:
    for start in (True, False):  # whatever state torch is in, the CPU run leaves it so
        torch.backends.cudnn.benchmark = start
        torch.backends.cudnn.allow_tf32 = start
        torch.set_float32_matmul_precision("high" if start else "highest")
        before = _math_flags()
        configure_math(TrainSection(tf32=tf32, cudnn_benchmark=autotune), CPU)
        assert _math_flags() == before


def test_configure_math_sets_the_flags_on_cuda(restored_math_flags: None) -> None:
    # Only flags are set, no CUDA call is made: the mapping can be checked on a CPU-only torch.
    cuda = torch.device("cuda", 0)
    configure_math(TrainSection(tf32=True), cuda)
    assert torch.backends.cudnn.benchmark is True
    assert torch.backends.cuda.matmul.allow_tf32 is True and torch.backends.cudnn.allow_tf32 is True
    assert torch.get_float32_matmul_precision() == "high"

    configure_math(TrainSection(tf32=False, cudnn_benchmark=False), cuda)
    assert torch.backends.cudnn.benchmark is False
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
    assert torch.get_float32_matmul_precision() == "highest"

    before = _math_flags()[1:]
    configure_math(TrainSection(), cuda)  # tf32 null: torch's flags as they are
    assert torch.backends.cudnn.benchmark is True
    assert _math_flags()[1:] == before


def _shown(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["config", "show", *argv]) == 0
    return yaml.safe_load(capsys.readouterr().out)["train"]


def test_flags_reach_the_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    default = _shown(capsys)
    assert default["tf32"] is None and default["cudnn_benchmark"] is True
    shown = _shown(capsys, "--tf32", "--set", "train.cudnn_benchmark=false")
    assert shown["tf32"] is True and shown["cudnn_benchmark"] is False
    assert _shown(capsys, "--set", "train.tf32=false")["tf32"] is False
    cfg = load_config(overrides={"train.tf32": "true", "train.cudnn_benchmark": "false"})
    assert cfg.train.tf32 is True and cfg.train.cudnn_benchmark is False


@pytest.mark.parametrize("key", ["train.tf32", "train.cudnn_benchmark"])
def test_bad_values_are_rejected(key: str) -> None:
    with pytest.raises(UserError, match=key):
        load_config(overrides={key: "maybe"})
