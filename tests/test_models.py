"""The model zoo: shapes, gradients, torchvision parity, blocks, FLOPs, user errors.

Big models are built under ``torch.device("meta")``: shapes and parameter
counts are real, but nothing is allocated or computed, so the file stays fast.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nodescale.config.schema import ModelSection
from nodescale.errors import UserError
from nodescale.models.cnn import ConvBlock
from nodescale.models.introspect import (
    forward_flops_per_sample,
    repeated_blocks,
    training_flops_per_sample,
)
from nodescale.models.registry import MODELS, build_model
from nodescale.models.resnet import BasicBlock, Bottleneck
from nodescale.models.spec import InputSpec
from nodescale.models.vit import EncoderBlock

DIGITS = InputSpec((1, 8, 8), 10)
CIFAR = InputSpec((3, 32, 32), 10)
IMAGENET = InputSpec((3, 224, 224), 1000)
FEATURES = InputSpec((20,), 1, task="regression")

IMAGE_MODELS = sorted(name for name, entry in MODELS.items() if entry.task == "classification")


def build(name: str, spec: InputSpec, device: str = "cpu", **fields: object) -> nn.Module:
    with torch.device(device):
        return build_model(ModelSection(name=name, **fields), spec)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- building and shapes -------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [DIGITS, CIFAR], ids=["digits", "cifar"])
@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_every_image_model_gives_logits_per_class(name: str, spec: InputSpec) -> None:
    model = build(name, spec, device="meta")  # shapes without compute
    logits = model(torch.empty(4, *spec.shape, device="meta"))
    assert logits.shape == (4, spec.num_classes)


def test_toy_maps_features_to_targets() -> None:
    model = build("toy", FEATURES)
    assert model(torch.randn(5, 20)).shape == (5, 1)


@pytest.mark.parametrize("name", ["resnet18", "vit_tiny"])
def test_imagenet_sized_images_run_on_cpu(name: str) -> None:
    model = build(name, IMAGENET).eval()
    with torch.no_grad():
        assert model(torch.randn(2, *IMAGENET.shape)).shape == (2, 1000)


@pytest.mark.parametrize("spec", [DIGITS, InputSpec((1, 28, 28), 10), CIFAR, InputSpec((3, 12, 20), 7)])
def test_cnn_fits_image_sizes(spec: InputSpec) -> None:
    model = build("cnn", spec)
    assert model(torch.randn(3, *spec.shape)).shape == (3, spec.num_classes)


# --- gradients -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "spec"),
    [("toy", FEATURES), ("cnn", DIGITS), ("resnet18", DIGITS), ("resnet50", DIGITS), ("vit_tiny", DIGITS)],
    ids=["toy", "cnn", "resnet18", "resnet50", "vit_tiny"],
)
def test_backward_reaches_every_parameter(name: str, spec: InputSpec) -> None:
    torch.manual_seed(0)
    model = build(name, spec)
    if name == "vit_tiny":
        # torchvision zero-initialises the ViT head, which blocks every other
        # gradient in the very first step; give it weights to test the rest.
        nn.init.normal_(model.head.weight)
    model(torch.randn(2, *spec.shape)).square().sum().backward()
    for param_name, param in model.named_parameters():
        assert param.grad is not None, f"{param_name} is not used in forward"
        assert torch.isfinite(param.grad).all(), param_name
        assert param.grad.abs().sum() > 0, f"{param_name} got an all-zero gradient"


# --- torchvision parity --------------------------------------------------------------------------

TORCHVISION_PARAMS = {
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
    "vit_b16": 86_567_656,
}


@pytest.mark.parametrize(("name", "expected"), TORCHVISION_PARAMS.items())
def test_parameter_counts_equal_torchvision(name: str, expected: int) -> None:
    model = build(name, IMAGENET, device="meta", stem="imagenet")
    assert num_params(model) == expected


def test_vit_b16_uses_16_pixel_patches_at_224() -> None:
    model = build("vit_b16", IMAGENET, device="meta")
    assert model.conv_proj.kernel_size == (16, 16)
    assert model.pos_embedding.shape == (1, 14 * 14 + 1, 768)


# --- ResNet stem ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("side", "stem", "expected"),
    [
        (32, "auto", "cifar"),
        (64, "auto", "cifar"),
        (224, "auto", "imagenet"),
        (32, "imagenet", "imagenet"),
        (224, "cifar", "cifar"),
    ],
)
def test_resnet_stem(side: int, stem: str, expected: str) -> None:
    model = build("resnet18", InputSpec((3, side, side), 10), device="meta", stem=stem)
    assert model.stem_kind == expected
    if expected == "cifar":
        assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
        assert isinstance(model.maxpool, nn.Identity)
    else:
        assert model.conv1.kernel_size == (7, 7) and model.conv1.stride == (2, 2)
        assert isinstance(model.maxpool, nn.MaxPool2d)


def test_resnet_takes_input_channels_from_spec() -> None:
    model = build("resnet50", DIGITS, device="meta")
    assert model.conv1.in_channels == 1


# --- ViT patch size and dropout ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("side", "patch"),
    [(8, 1), (32, 4), (64, 8), (128, 16), (224, 16), (28, 4)],  # 28 // 8 = 3 does not divide 28
)
def test_vit_default_patch_size(side: int, patch: int) -> None:
    model = build("vit_tiny", InputSpec((3, side, side), 10), device="meta")
    assert model.patch_size == patch
    assert model.pos_embedding.shape[1] == (side // patch) ** 2 + 1


def test_vit_patch_size_from_config() -> None:
    model = build("vit_small", CIFAR, device="meta", patch_size=8)
    assert model.pos_embedding.shape == (1, 4 * 4 + 1, 384)


def test_vit_patch_size_that_does_not_divide_the_image_is_a_user_error() -> None:
    with pytest.raises(UserError) as caught:
        build("vit_tiny", CIFAR, device="meta", patch_size=5)
    message = str(caught.value)
    assert "5" in caught.value.what and "32" in message
    assert "model.patch_size" in caught.value.hint and "divisor of 32" in caught.value.hint


def test_vit_dropout_from_config() -> None:
    model = build("vit_tiny", CIFAR, device="meta", dropout=0.1)
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and all(m.p == 0.1 for m in dropouts)


# --- wrong kinds of input ------------------------------------------------------------------------


def test_toy_rejects_images() -> None:
    with pytest.raises(UserError, match="feature vectors"):
        build("toy", CIFAR)


@pytest.mark.parametrize("name", ["cnn", "resnet18", "vit_tiny"])
def test_image_models_reject_feature_vectors(name: str) -> None:
    with pytest.raises(UserError, match=r"\(C, H, W\)"):
        build(name, FEATURES, device="meta")


def test_cnn_rejects_images_smaller_than_4x4() -> None:
    with pytest.raises(UserError, match="3x3"):
        build("cnn", InputSpec((1, 3, 3), 10))


# --- repeated blocks -----------------------------------------------------------------------------


class CompiledStandIn(nn.Module):
    """Holds the model as ``_orig_mod`` like torch.compile's wrapper (without its ~3 s import)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._orig_mod = model


@pytest.mark.parametrize(
    ("name", "spec", "block_type", "count"),
    [
        ("resnet18", CIFAR, BasicBlock, 8),
        ("resnet50", CIFAR, Bottleneck, 16),
        ("vit_b16", IMAGENET, EncoderBlock, 12),
        ("cnn", DIGITS, ConvBlock, 2),
        ("toy", FEATURES, None, 0),
    ],
)
def test_repeated_blocks(name: str, spec: InputSpec, block_type: type | None, count: int) -> None:
    model = build(name, spec, device="meta")
    blocks = repeated_blocks(model)
    assert len(blocks) == count
    assert all(type(block) is block_type for block in blocks)
    assert repeated_blocks(nn.DataParallel(model)) == blocks
    assert repeated_blocks(CompiledStandIn(nn.DataParallel(model))) == blocks


def test_repeated_blocks_are_in_forward_order() -> None:
    model = build("resnet34", CIFAR, device="meta")
    blocks = repeated_blocks(model)
    expected = [*model.layer1, *model.layer2, *model.layer3, *model.layer4]
    assert blocks == expected  # modules compare by identity


# --- FLOPs ---------------------------------------------------------------------------------------


def cnn_flops(spec: InputSpec) -> int:
    """The ConvNet's forward FLOPs by hand: 2 per multiply-add of convs and the linear layer."""
    channels, height, width = spec.shape
    conv1 = 2 * channels * 16 * 5 * 5 * height * width  # 'same' padding keeps H x W
    conv2 = 2 * 16 * 32 * 5 * 5 * (height // 2) * (width // 2)
    fc = 2 * (32 * (height // 4) * (width // 4)) * spec.num_classes
    return conv1 + conv2 + fc


@pytest.mark.parametrize("spec", [DIGITS, CIFAR, InputSpec((1, 28, 28), 10)])
def test_cnn_flops_match_the_analytic_count(spec: InputSpec) -> None:
    assert forward_flops_per_sample(build("cnn", spec), spec) == cnn_flops(spec)


def test_resnet50_flops_are_twice_the_quoted_macs() -> None:
    flops = forward_flops_per_sample(build("resnet50", IMAGENET, device="meta"), IMAGENET)
    assert flops == pytest.approx(8.2e9, rel=0.02)


def test_training_flops_are_three_forwards() -> None:
    model = build("cnn", DIGITS)
    assert training_flops_per_sample(model, DIGITS) == 3 * forward_flops_per_sample(model, DIGITS)


def test_flops_leave_the_model_alone_and_see_through_wrappers() -> None:
    model = build("cnn", CIFAR)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    assert forward_flops_per_sample(CompiledStandIn(nn.DataParallel(model)), CIFAR) == cnn_flops(CIFAR)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())
    assert model.training  # the meta copy is put in eval mode, not the model


def test_flops_of_resnet152_at_224_are_counted_on_the_meta_device() -> None:
    # No timing here (a timed unit test fails on a loaded machine): on the meta device nothing is computed.
    model = build("resnet152", IMAGENET, device="meta")
    flops = forward_flops_per_sample(model, IMAGENET)
    assert all(p.is_meta for p in model.parameters())
    assert flops == pytest.approx(2 * 11.5e9, rel=0.02)  # torchvision quotes 11.51 GMACs
