"""Decoder-only transformers: the GPT-2 and Llama flavours of one ``GPT`` module, nanoGPT/torchtitan style.

GPT-2 flavour: learned positions, LayerNorm, a GELU MLP, biases. Llama flavour: rotary
positions (RoPE, in Hugging Face's rotate-half layout), RMSNorm, a SwiGLU MLP,
grouped-query attention, no biases. Attention goes through
``scaled_dot_product_attention(is_causal=True)``, so PyTorch picks a flash or
memory-efficient kernel where one exists.

The vocabulary (the dataset's) is padded to a multiple of 64 for tensor-core friendly
shapes; the padding rows are never targets, so they only learn to be unlikely and the
loss and accuracy over the real tokens are unchanged. Each ``Block`` is one FSDP unit
and one activation-checkpointing unit. The module holds no parallelism: strategies
wrap it from outside, reading ``block_types`` and ``tensor_parallel_plan``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from nodescale.models.section import ModelSection

VOCAB_MULTIPLE = 64
INIT_STD = 0.02  # GPT-2's (and nanoGPT's) weight initialisation


@dataclass(frozen=True)
class GPTShape:
    """One preset's shape; the vocabulary and the sequence length come from the dataset."""

    layers: int
    dim: int
    heads: int
    flavour: Literal["gpt2", "llama"] = "gpt2"
    kv_heads: int | None = None  # grouped-query attention; None: one key/value head per query head
    hidden: int | None = None  # MLP width; None: 4 x dim
    context: int | None = None  # the longest sequence the preset takes; None: any (positions sized to it)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


# Llama flavour: on bytes it leaves the unigram plateau in a fraction of the GPT-2 flavour's steps.
NANO = GPTShape(layers=4, dim=128, heads=4, flavour="llama", kv_heads=2, hidden=384)
GPT2_SMALL = GPTShape(layers=12, dim=768, heads=12, context=1024)
GPT2_MEDIUM = GPTShape(layers=24, dim=1024, heads=16, context=1024)
# Llama-3.2-1B's shape, without its long-context RoPE scaling.
LLAMA_1B = GPTShape(layers=16, dim=2048, heads=32, flavour="llama", kv_heads=8, hidden=8192, context=131072,
                    rope_theta=500000.0)


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def rope_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of the rotary angles, ``(length, head_dim)``, both halves alike (rotate-half layout)."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), frequencies)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (batch, heads, tokens, head_dim) by its tokens' positions."""
    tokens, half = x.shape[-2], x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    # The fp32 tables promote a bf16 x: back to its dtype, as attention needs q, k, v alike.
    return (x * cos[:tokens] + rotated * sin[:tokens]).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections (column-split under tensor parallelism)."""

    def __init__(self, shape: GPTShape, dropout: float) -> None:
        super().__init__()
        if shape.dim % shape.heads or shape.heads % (shape.kv_heads or shape.heads):
            raise ValueError(f"width {shape.dim}, {shape.heads} heads and {shape.kv_heads} key/value heads do not "
                             "divide evenly")
        bias = shape.flavour == "gpt2"
        kv_width = (shape.kv_heads or shape.heads) * shape.head_dim
        self.head_dim = shape.head_dim
        self.dropout = dropout
        self.wq = nn.Linear(shape.dim, shape.dim, bias=bias)
        self.wk = nn.Linear(shape.dim, kv_width, bias=bias)
        self.wv = nn.Linear(shape.dim, kv_width, bias=bias)
        self.wo = nn.Linear(shape.dim, shape.dim, bias=bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # -1 heads: the local ones when tensor parallelism splits the projections.
        q, k, v = (proj(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.wq, self.wk, self.wv))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                             is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(out.transpose(1, 2).reshape(batch, tokens, -1))


class FeedForward(nn.Module):
    """GPT-2: ``w2(gelu(w1 x))``; Llama (SwiGLU): ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        hidden = shape.hidden or 4 * shape.dim
        gpt2 = shape.flavour == "gpt2"
        self.w1 = nn.Linear(shape.dim, hidden, bias=gpt2)
        self.w2 = nn.Linear(hidden, shape.dim, bias=gpt2)
        self.w3 = None if gpt2 else nn.Linear(shape.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x), approximate="tanh"))  # GPT-2's "gelu_new"
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def make_norm(shape: GPTShape) -> nn.Module:
    if shape.flavour == "llama":
        return nn.RMSNorm(shape.dim, eps=shape.norm_eps)
    return nn.LayerNorm(shape.dim, eps=shape.norm_eps)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attention(norm(x))``, then ``x + feed_forward(norm(x))``."""

    def __init__(self, shape: GPTShape, dropout: float) -> None:
        super().__init__()
        self.attention_norm = make_norm(shape)
        self.attention = Attention(shape, dropout)
        self.ffn_norm = make_norm(shape)
        self.feed_forward = FeedForward(shape)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), rope))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class GPT(nn.Module):
    """Token embedding, (learned positions,) blocks, final norm, output layer: ``(B, T)`` tokens to
    ``(B, T, padded vocabulary)`` logits of each next token."""

    block_types: tuple[type[nn.Module], ...] = (Block,)

    def __init__(self, shape: GPTShape, vocab_size: int, seq_len: int, tie_weights: bool = True,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.shape, self.vocab_size = shape, vocab_size
        self.tok_embeddings = nn.Embedding(padded_vocab(vocab_size), shape.dim)
        self.pos_embeddings = (nn.Embedding(shape.context or seq_len, shape.dim) if shape.flavour == "gpt2"
                               else None)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(Block(shape, dropout) for _ in range(shape.layers))
        self.norm = make_norm(shape)
        self.output = nn.Linear(shape.dim, padded_vocab(vocab_size), bias=False)
        if shape.flavour == "llama":  # not in the state dict: computed, and sized to this run's windows
            cos, sin = rope_tables(shape.head_dim, seq_len, shape.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self._initialise()
        if tie_weights:  # after initialisation: the embedding's values are the output layer's
            self.output.weight = self.tok_embeddings.weight

    def _initialise(self) -> None:
        # nanoGPT's: N(0, 0.02) weights, zero biases, and residual projections scaled by 1/sqrt(2 x layers)
        # so the residual stream's variance does not grow with depth.
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                residual = name.endswith(("attention.wo", "feed_forward.w2"))
                std = INIT_STD / math.sqrt(2 * self.shape.layers) if residual else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        x = self.dropout(x)
        rope = (self.rope_cos, self.rope_sin) if self.pos_embeddings is None else None
        for layer in self.layers:
            x = layer(x, rope)
        return self.output(self.norm(x))

    def tensor_parallel_plan(self) -> dict[str, Literal["colwise", "rowwise"]]:
        """How each block's linear layers split under tensor parallelism (names within a block): Megatron's
        pairing, a column split feeding a row split, so each pair needs one reduction. Declared, not applied:
        applying it is the strategies' job."""
        plan: dict[str, Literal["colwise", "rowwise"]] = {
            "attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise",
            "attention.wo": "rowwise", "feed_forward.w1": "colwise", "feed_forward.w2": "rowwise",
        }
        if self.shape.flavour == "llama":
            plan["feed_forward.w3"] = "colwise"
        return plan

    def tensor_parallel_divisors(self) -> dict[str, int]:
        """What a tensor-parallel group's size must divide besides the planned layers' widths: each rank
        takes whole attention heads, and whole key/value heads (grouped-query attention)."""
        return {"attention heads": self.shape.heads, "key/value heads": self.shape.kv_heads or self.shape.heads}

    def estimated_training_flops_per_token(self, seq_len: int) -> int:
        """``6N + 12 L d T`` (PaLM, appendix B), the FLOP counter's cross-check: N the weights of matrix
        products (the output layer's; not the embeddings, which are looked up), L layers, d the width."""
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul_weights + 12 * self.shape.layers * self.shape.dim * seq_len


def _build(name: str, shape: GPTShape, cfg: ModelSection, spec: InputSpec) -> GPT:
    if spec.task != "language_modeling" or len(spec.shape) != 1:
        raise UserError(f"model {name!r} with samples of shape {tuple(spec.shape)} for {spec.task}",
                        "a language model takes windows of tokens", "use a token dataset: --dataset pydoc or tokens")
    seq_len = spec.shape[0]
    if shape.context is not None and seq_len > shape.context:
        raise UserError(f"--seq-len {seq_len} with model {name!r}",
                        f"is longer than the model's context of {shape.context} tokens",
                        f"use --seq-len {shape.context} or less")
    return GPT(shape, spec.num_classes, seq_len, tie_weights=cfg.tie_weights, dropout=cfg.dropout)


def build_gpt_nano(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """Llama flavour, 4 layers, width 128, 4 heads over 2 key/value heads, SwiGLU 384: under a million
    parameters with a byte vocabulary (tests, CPU)."""
    return _build("gpt_nano", NANO, cfg, spec)


def build_gpt2_small(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """GPT-2 small: 12 layers, width 768, 12 heads, 1024 positions (124M with GPT-2's vocabulary)."""
    return _build("gpt2_small", GPT2_SMALL, cfg, spec)


def build_gpt2_medium(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """GPT-2 medium: 24 layers, width 1024, 16 heads, 1024 positions (355M with GPT-2's vocabulary)."""
    return _build("gpt2_medium", GPT2_MEDIUM, cfg, spec)


def build_llama_1b(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """Llama-3.2-1B-like: 16 layers, width 2048, 32 heads over 8 key/value heads, SwiGLU 8192, RoPE 500000."""
    return _build("llama_1b", LLAMA_1B, cfg, spec)
