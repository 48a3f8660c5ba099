"""Vision Transformers (ViT-Ti, ViT-S, ViT-B/16) in torchvision's layout.

Patches are embedded by a strided convolution, a learned class token is
prepended, a learned position embedding added, then pre-LayerNorm encoder
blocks run and the class token's final state goes through a linear head.
Parameter counts equal torchvision's (``vit_b_16``: 86,567,656 at 224x224 with
1000 classes), though the names differ (``qkv``/``proj`` for its
``in_proj``/``out_proj``), so its checkpoints need renaming to load.
Attention goes through ``torch.nn.functional.scaled_dot_product_attention``
so that PyTorch picks a flash or memory-efficient kernel where one exists.

Small images get a small default patch so the sequence stays around 8x8
patches (CIFAR's 32x32 uses 4x4 patches), rather than one or two tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from nodescale.models.section import ModelSection

LN_EPS = 1e-6  # torchvision's (and the original ViT's) LayerNorm epsilon


@dataclass(frozen=True)
class ViTSize:
    """Width, depth, heads and MLP width of one ViT preset."""

    dim: int
    depth: int
    heads: int
    mlp_dim: int
    patch_size: int = 16  # for images of at least LARGE_IMAGE_SIDE pixels


LARGE_IMAGE_SIDE = 128  # from this side on, the preset's own patch size is the default
SMALL_IMAGE_PATCHES = 8  # below it, aim for about this many patches per side

TINY = ViTSize(dim=192, depth=12, heads=3, mlp_dim=768)
SMALL = ViTSize(dim=384, depth=12, heads=6, mlp_dim=1536)
BASE = ViTSize(dim=768, depth=12, heads=12, mlp_dim=3072)


class SelfAttention(nn.Module):
    """Multi-head self-attention: one fused q/k/v projection and an output projection.

    The same parameters as ``nn.MultiheadAttention`` (``in_proj`` and
    ``out_proj``, with biases), computed with scaled_dot_product_attention.
    """

    def __init__(self, dim: int, heads: int, attention_dropout: float = 0.0) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"width {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        # nn.MultiheadAttention's initialisation.
        nn.init.xavier_uniform_(self.qkv.weight)
        nn.init.zeros_(self.qkv.bias)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        # (B, N, 3D) -> 3 x (B, heads, N, head_dim)
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        dropout = self.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class MLP(nn.Sequential):
    """Linear, GELU, dropout, linear, dropout."""

    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__(
            nn.Linear(dim, hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, dim),
            nn.Dropout(dropout),
        )
        for module in self.modules():
            if isinstance(module, nn.Linear):  # torchvision's MLPBlock initialisation
                nn.init.xavier_uniform_(module.weight)
                nn.init.normal_(module.bias, std=1e-6)


class EncoderBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.self_attention = SelfAttention(dim, heads)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = MLP(dim, mlp_dim, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attention(self.ln_1(x)))
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    """Patch embedding, class token, position embedding, encoder blocks, head."""

    block_types: tuple[type[nn.Module], ...] = (EncoderBlock,)

    def __init__(self, size: ViTSize, spec: InputSpec, patch_size: int, dropout: float) -> None:
        super().__init__()
        channels, height, width = spec.shape
        self.patch_size = patch_size
        self.conv_proj = nn.Conv2d(channels, size.dim, kernel_size=patch_size, stride=patch_size)
        num_patches = (height // patch_size) * (width // patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, size.dim))
        self.pos_embedding = nn.Parameter(torch.empty(1, num_patches + 1, size.dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *(EncoderBlock(size.dim, size.heads, size.mlp_dim, dropout) for _ in range(size.depth))
        )
        self.ln = nn.LayerNorm(size.dim, eps=LN_EPS)
        self.head = nn.Linear(size.dim, spec.num_classes)

        # torchvision's initialisation. The zero head makes every first
        # prediction uniform; only the head gets a non-zero gradient in the
        # very first step, everything trains from the second on.
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / (channels * patch_size**2)))
        nn.init.zeros_(self.conv_proj.bias)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)  # (B, D, h, w) -> (B, h*w, D)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.dropout(x + self.pos_embedding)
        x = self.ln(self.blocks(x))
        return self.head(x[:, 0])


def choose_patch_size(cfg: ModelSection, spec: InputSpec, size: ViTSize) -> int:
    """``cfg.patch_size`` if set (it must divide both image sides), else a default.

    The default is the preset's patch (16) for images of 128 pixels and more,
    else ``max(1, side // 8)``: 32 -> 4, 64 -> 8, 8 -> 1. Where that does not
    divide the sides (28x28 MNIST: 3), the nearest divisor is used, the larger
    on a tie (MNIST: 4, so 7x7 patches).
    """
    height, width = spec.shape[1:]
    side = math.gcd(height, width)  # a patch must tile both sides
    divisors = [d for d in range(1, side + 1) if side % d == 0]
    if cfg.patch_size is not None:
        if cfg.patch_size not in divisors:
            sides = f"side {height}" if height == width else f"sides {height} and {width}"
            raise UserError(
                f"patch size {cfg.patch_size} with {height}x{width} images",
                f"the patch size must divide the image {sides}",
                f"set model.patch_size to a divisor of {side}: {', '.join(map(str, divisors))}",
            )
        return cfg.patch_size
    smaller = min(height, width)
    target = size.patch_size if smaller >= LARGE_IMAGE_SIDE else max(1, smaller // SMALL_IMAGE_PATCHES)
    return min(divisors, key=lambda d: (abs(d - target), -d))


def _build(name: str, size: ViTSize, cfg: ModelSection, spec: InputSpec) -> VisionTransformer:
    if not spec.is_image:
        raise UserError(
            f"model {name!r} with samples of shape {tuple(spec.shape)}",
            "needs images of shape (C, H, W)",
            "use model toy for feature vectors",
        )
    return VisionTransformer(size, spec, choose_patch_size(cfg, spec, size), cfg.dropout)


def build_vit_tiny(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """ViT-Ti: width 192, 12 blocks, 3 heads, MLP 768."""
    return _build("vit_tiny", TINY, cfg, spec)


def build_vit_small(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """ViT-S: width 384, 12 blocks, 6 heads, MLP 1536."""
    return _build("vit_small", SMALL, cfg, spec)


def build_vit_b16(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """ViT-B/16: width 768, 12 blocks, 12 heads, MLP 3072 (patch 16 from 128 pixels on)."""
    return _build("vit_b16", BASE, cfg, spec)
