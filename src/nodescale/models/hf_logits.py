"""A Hugging Face causal language model as the engine sees it: token ids in, logits out.

Kept free of ``transformers`` (only torch): ``introspect.unwrap`` sees through it.
"""

from __future__ import annotations

import torch
from torch import nn


class CausalLMLogits(nn.Module):
    """``forward(input_ids)`` of shape (batch, seq_len) returns the logits, (batch, seq_len, vocab).

    It takes over the Hugging Face model's own tables of parameters, buffers and submodules
    instead of holding that model as a child, so names are Hugging Face's, unprefixed
    (``model.layers.0.self_attn.q_proj.weight``) in every state dict: full checkpoints, FSDP's
    sharded ones, DeepSpeed's, ``checkpoint export``. ``causal_lm`` (what ``unwrap`` returns)
    is the model itself, for ``save_pretrained`` and ``generate``. Its decoder layers, the blocks
    of FSDP and activation checkpointing, are those it declares (``_no_split_modules``).
    """

    def __init__(self, causal_lm: nn.Module) -> None:
        super().__init__()
        # Plain attribute assignment would register causal_lm as a child and prefix every name.
        self.__dict__.update(
            causal_lm=causal_lm, _parameters=causal_lm._parameters, _buffers=causal_lm._buffers,
            _non_persistent_buffers_set=causal_lm._non_persistent_buffers_set, _modules=causal_lm._modules,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # No key-value cache: training sees every position at once, and a cache would only cost memory.
        return self.causal_lm(input_ids=input_ids, use_cache=False).logits

    def train(self, mode: bool = True) -> CausalLMLogits:
        self.causal_lm.training = mode  # its children, shared, follow through nn.Module.train
        return super().train(mode)
