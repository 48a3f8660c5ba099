"""``--model hf:DIR``: a Hugging Face causal language model built from a local directory, never downloaded.

``DIR/config.json`` gives the architecture (``AutoConfig``); the weights are DIR's
safetensors files (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) when there are any, else the model starts from
transformers' own initialisation. Every call passes ``local_files_only`` and
``trust_remote_code=False``: nothing is fetched and no code from DIR runs.
Attention goes through torch's ``scaled_dot_product_attention`` (``sdpa``), and
parameters are fp32 whatever DIR stores (``--precision`` decides the compute).
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

from torch import nn

from nodescale.errors import UserError
from nodescale.models.hf_logits import CausalLMLogits
from nodescale.plugins.hf_dirs import check_hf_dir, hf_dir

if TYPE_CHECKING:
    from nodescale.models.section import ModelSection
    from nodescale.models.spec import InputSpec

INSTALL_HINT = "pip install 'nodescale[lm]' (transformers, tokenizers, safetensors, datasets)"
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
OTHER_WEIGHT_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
_SETTINGS: dict[str, Any] = {"attn_implementation": "sdpa", "trust_remote_code": False}


def build_hf(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """The ``hf:DIR`` model, with DIR's weights if it has any, for samples described by ``spec``."""
    config = hf_config(cfg.name)
    _check_fits_data(cfg.name, config, spec)
    causal_lm = hf_causal_lm(cfg.name, config, with_weights=True)
    causal_lm.config.use_cache = False  # also when evaluation calls it unwrapped
    return CausalLMLogits(causal_lm)


def transformers_module(what: str) -> ModuleType:
    """``transformers``, imported here and only here; its absence is a ``UserError``."""
    try:
        import transformers
    except ImportError as exc:
        raise UserError(what, f"needs the Hugging Face transformers package, which does not import ({exc})",
                        INSTALL_HINT) from None
    transformers.utils.logging.disable_progress_bar()  # one bar per rank per file would bury nodescale's output
    return transformers


def hf_config(name: str) -> Any:
    """``AutoConfig`` of ``hf:DIR``, which must be a causal language model transformers knows."""
    check_hf_dir(name)  # again on each node: its file system may differ from the launcher's
    transformers = transformers_module(f"model {name!r}")
    directory = hf_dir(name)
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"model {name!r}", f"transformers {transformers.__version__} cannot build "
                        f"{directory / 'config.json'}: {first}",
                        "name a model_type transformers knows (llama, gpt2, mistral, qwen2, ...); a newer "
                        "architecture needs a newer transformers (pip install -U transformers)") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(f"model {name!r}", f"its model_type {config.model_type!r} is not a causal language model "
                        "(transformers has no AutoModelForCausalLM for it)",
                        "use a decoder-only model's directory (llama, gpt2, mistral, qwen2, ...); for other "
                        "models build them in your own function: --model mymodel.py:build")
    return config


def hf_causal_lm(name: str, config: Any, with_weights: bool) -> nn.Module:
    """The Hugging Face model of ``config``; with DIR's safetensors weights if ``with_weights`` and it has some."""
    transformers = transformers_module(f"model {name!r}")
    directory = hf_dir(name)
    if not with_weights or not any((directory / f).is_file() for f in SAFETENSORS_FILES):
        others = [f for f in OTHER_WEIGHT_FILES if (directory / f).is_file()]
        if with_weights and others:  # weights nodescale does not read: refuse rather than train from scratch
            raise UserError(f"model {name!r}", f"its weights are in {others[0]}, not in safetensors",
                            "convert them once: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR) "
                            "writes model.safetensors; then --model hf:NEW_DIR")
        return transformers.AutoModelForCausalLM.from_config(config, **_SETTINGS).float()
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, config=config, local_files_only=True, use_safetensors=True, output_loading_info=True,
        **_SETTINGS)
    missing = sorted(map(str, info["missing_keys"])) + sorted(map(str, info["mismatched_keys"]))
    if missing:  # transformers would only warn and leave them random
        raise UserError(f"model {name!r}", f"its safetensors weights do not cover the model: {len(missing)} "
                        f"missing or misshapen, e.g. {missing[0]}",
                        "give the config.json the weights were saved with")
    return model.float()  # fp32 master weights, however DIR stores them


def _check_fits_data(name: str, config: Any, spec: InputSpec) -> None:
    """The samples are token sequences within the model's context, their ids within its vocabulary."""
    if spec.task != "language_modeling":
        raise UserError(f"model {name!r} with {spec.task} samples of shape {spec.shape}",
                        "a causal language model takes token ids and predicts the next ones",
                        "give it token data: (ids, next ids) pairs of int64, each of shape (seq_len,)")
    context = getattr(config, "max_position_embeddings", None)
    seq_len = spec.shape[-1]
    if isinstance(context, int) and seq_len > context:
        raise UserError(f"sequence length {seq_len}", f"is longer than the context of model {name!r} "
                        f"({context} positions, max_position_embeddings in its config.json)",
                        f"use sequences of at most {context} tokens")
    if spec.num_classes > config.vocab_size:
        raise UserError(f"a vocabulary of {spec.num_classes} tokens in the dataset",
                        f"is larger than model {name!r}'s ({config.vocab_size}, vocab_size in its config.json)",
                        "tokenise with the model's own tokenizer")

