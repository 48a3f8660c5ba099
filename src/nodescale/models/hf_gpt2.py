"""A built-in GPT's weights as Hugging Face's ``GPT2LMHeadModel``: names mapped, Conv1D weights transposed.

GPT-2's Hugging Face model keeps its attention and MLP projections in ``Conv1D``
layers, whose weight is ``(in, out)``: the transpose of ``nn.Linear``'s ``(out, in)``
(``y = x @ W + b`` against ``y = x @ W.T + b``). The built-in GPT uses ``nn.Linear``,
so those four weights per block are transposed on the way out; everything else is
only renamed. Shapes give the configuration; what they cannot tell (heads, the
activation) comes from ``GPT2_EXPORTS``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

# Built-in GPT parameter name -> GPT2LMHeadModel's; "{i}" is the block index. The left-hand
# sides are nanoGPT's names (GPT-2's own, in nn.Linear layout): the built-in GPT's go there.
GPT2_NAMES: dict[str, str] = {
    "transformer.wte.weight": "transformer.wte.weight",
    "transformer.wpe.weight": "transformer.wpe.weight",
    **{f"transformer.h.{{i}}.{part}": f"transformer.h.{{i}}.{part}" for part in (
        "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
        "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
        "mlp.c_proj.bias")},
    "transformer.ln_f.weight": "transformer.ln_f.weight",
    "transformer.ln_f.bias": "transformer.ln_f.bias",
    "lm_head.weight": "lm_head.weight",  # tied to wte where the built-in ties them
}
# GPT2LMHeadModel's Conv1D weights (by the end of their names): transposed from nn.Linear's layout.
GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Built-in models exported as GPT2LMHeadModel -> the GPT2Config settings their shapes do not tell,
# e.g. "gpt2_small": {"n_head": 12, "activation_function": "gelu"} (exact GELU; GPT-2's own is "gelu_new").
GPT2_EXPORTS: dict[str, dict[str, Any]] = {}


def gpt2_state(builtin: Mapping[str, torch.Tensor], names: Mapping[str, str] = GPT2_NAMES) -> dict[str, torch.Tensor]:
    """``builtin``'s tensors under GPT2LMHeadModel's names, Conv1D weights transposed."""
    patterns = [(re.compile(re.escape(ours).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$"), theirs)
                for ours, theirs in names.items()]
    converted: dict[str, torch.Tensor] = {}
    for key, tensor in builtin.items():
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
