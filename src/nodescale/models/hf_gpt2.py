"""A built-in GPT as Hugging Face's ``GPT2LMHeadModel``: q, k, v fused, names mapped, Conv1D weights transposed.

GPT-2's Hugging Face model keeps its attention and MLP projections in ``Conv1D``
layers, whose weight is ``(in, out)``: the transpose of ``nn.Linear``'s ``(out, in)``
(``y = x @ W + b`` against ``y = x @ W.T + b``), and projects q, k and v in one
layer, ``c_attn``. The built-in GPT uses separate ``nn.Linear`` layers, so its q, k, v
projections are stacked into one, those four weights per block are transposed on the
way out, and everything else is only renamed. Shapes give the configuration; what
they cannot tell (heads, the activation, the norm's epsilon) comes from ``GPT2_EXPORTS``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nodescale.models.gpt import GPT2_MEDIUM, GPT2_SMALL, GPTShape

# Built-in GPT parameter name -> GPT2LMHeadModel's; "{i}" is the block index. "attention.wqkv" is
# wq, wk and wv fused by gpt2_state first: GPT-2 projects q, k and v in one layer, c_attn.
GPT2_NAMES: dict[str, str] = {
    "tok_embeddings.weight": "transformer.wte.weight",
    "pos_embeddings.weight": "transformer.wpe.weight",
    **{f"layers.{{i}}.{ours}.{kind}": f"transformer.h.{{i}}.{theirs}.{kind}"
       for ours, theirs in (("attention_norm", "ln_1"), ("attention.wqkv", "attn.c_attn"),
                            ("attention.wo", "attn.c_proj"), ("ffn_norm", "ln_2"), ("feed_forward.w1", "mlp.c_fc"),
                            ("feed_forward.w2", "mlp.c_proj"))
       for kind in ("weight", "bias")},
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",  # tied to wte where the built-in ties them
}
# GPT2LMHeadModel's Conv1D weights (by the end of their names): transposed from nn.Linear's layout.
GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# c_attn's output splits into q, k, v in this order, so the fused projection stacks them so.
QKV = ("wq", "wk", "wv")


def gpt2_settings(shape: GPTShape) -> dict[str, Any]:
    """The GPT2Config settings a built-in's weight shapes do not tell."""
    # The built-in's GELU is F.gelu(approximate="tanh"): "gelu_pytorch_tanh" calls that very function,
    # where "gelu_new" writes the same formula out in other operations (equal only to rounding).
    return {"n_head": shape.heads, "layer_norm_epsilon": shape.norm_eps, "activation_function": "gelu_pytorch_tanh"}


# Built-in models exported as GPT2LMHeadModel (the GPT-2 flavour's) -> their GPT2Config settings.
GPT2_EXPORTS: dict[str, dict[str, Any]] = {"gpt2_small": gpt2_settings(GPT2_SMALL),
                                           "gpt2_medium": gpt2_settings(GPT2_MEDIUM)}


def fuse_qkv(builtin: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``builtin`` with each block's ``attention.{wq,wk,wv}`` as one ``attention.wqkv``: their outputs
    stacked, q first (dim 0 of nn.Linear's ``(out, in)`` weight, and the biases alike)."""
    fused: dict[str, torch.Tensor] = {}
    for key, tensor in builtin.items():
        module, _, kind = key.rpartition(".")
        attention, _, projection = module.rpartition(".")
        if projection not in QKV or not attention.endswith("attention"):
            fused[key] = tensor
        elif projection == QKV[0]:
            fused[f"{attention}.wqkv.{kind}"] = torch.cat([builtin[f"{attention}.{p}.{kind}"] for p in QKV])
    return fused


def gpt2_state(builtin: Mapping[str, torch.Tensor], names: Mapping[str, str] = GPT2_NAMES) -> dict[str, torch.Tensor]:
    """``builtin``'s tensors (a GPT-2 flavoured built-in GPT's) under GPT2LMHeadModel's names: q, k, v
    fused, Conv1D weights transposed."""
    patterns = [(re.compile(re.escape(ours).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$"), theirs)
                for ours, theirs in names.items()]
    converted: dict[str, torch.Tensor] = {}
    for key, tensor in fuse_qkv(builtin).items():
        match = next(((m, theirs) for pattern, theirs in patterns if (m := pattern.match(key))), None)
        if match is None:
            raise ValueError(f"the built-in GPT's {key!r} has no GPT-2 name: add it to GPT2_NAMES")
        found, theirs = match
        name = theirs.format(i=found.groupdict().get("i"))
        converted[name] = tensor.t().contiguous() if name.endswith(GPT2_CONV1D) else tensor
    return converted


def gpt2_model(transformers: Any, state: Mapping[str, torch.Tensor], settings: Mapping[str, Any]) -> nn.Module:
    """A ``GPT2LMHeadModel`` holding ``state`` (GPT-2's names, from :func:`gpt2_state`), shaped by it.

    Biases the built-in leaves out (``bias=False``) are zeros here; ``lm_head`` is tied to
    ``wte`` unless the state holds a different one.
    """
    wte, wpe = state["transformer.wte.weight"], state["transformer.wpe.weight"]
    layers = 1 + max(int(key.split(".")[2]) for key in state if key.startswith("transformer.h."))
    head = state.get("lm_head.weight")
    tied = head is None or torch.equal(head, wte)
    config = transformers.GPT2Config(
        vocab_size=wte.shape[0], n_positions=wpe.shape[0], n_embd=wte.shape[1], n_layer=layers,
        n_inner=state["transformer.h.0.mlp.c_fc.weight"].shape[1], tie_word_embeddings=tied,
        bos_token_id=None, eos_token_id=None, **settings)
    model = transformers.GPT2LMHeadModel(config)
    full = {key: state.get(key, torch.zeros_like(value) if key.endswith(".bias") else None)
            for key, value in model.state_dict().items()}
    if tied:
        full["lm_head.weight"] = wte
    missing = [key for key, value in full.items() if value is None]
    if missing:
        raise ValueError(f"the built-in GPT's state has no {missing[0]} (and {len(missing) - 1} more)")
    model.load_state_dict(full, strict=True)
    return model
