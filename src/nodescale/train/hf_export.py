"""``nodescale checkpoint export --format hf``: a checkpoint as a Hugging Face model directory.

The directory holds ``config.json`` and ``model.safetensors`` (and DIR's tokenizer
files, for an ``hf:DIR`` model) and loads with ``AutoModelForCausalLM.from_pretrained``.
It is written whole into a temporary directory beside ``--out`` and renamed into place,
so a reader (another node, a job waiting for it) sees all of it or none of it.

Which models export: ``hf:DIR`` ones, whose checkpoints already use Hugging Face's
parameter names (see ``models.hf_logits``), and the built-ins in
``models.hf_gpt2.GPT2_EXPORTS``, as ``GPT2LMHeadModel``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

from nodescale.atomic_files import sync_directory
from nodescale.errors import UserError
from nodescale.models.hf import hf_causal_lm, hf_config, transformers_module
from nodescale.models.hf_gpt2 import GPT2_EXPORTS, gpt2_model, gpt2_state
from nodescale.plugins.hf_dirs import hf_dir, is_hf_model
from nodescale.train.export import consolidated_model_state, read_trainer_state

# Copied beside the weights when the hf: directory has them, so the export is a complete model directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")


def exportable_models() -> str:
    """The models ``--format hf`` takes, for messages."""
    return ", ".join(["hf:DIR models", *sorted(GPT2_EXPORTS)])


def export_hf(source: Path, out: Path, trust: bool = False) -> nn.Module:
    """Write checkpoint ``source``'s model into the new directory ``out``; returns the model written
    (``trust``: as for :func:`~nodescale.train.export.consolidated_model_state`)."""
    name = str(read_trainer_state(source).get("config", {}).get("model", {}).get("name"))
    if not is_hf_model(name) and name not in GPT2_EXPORTS:
        raise UserError(f"--format hf for model {name!r}", "has no Hugging Face equivalent; "
                        f"these export: {exportable_models()}",
                        "export its state dict instead: nodescale checkpoint export RUN --out model.pt")
    _check_out(out)
    state = consolidated_model_state(source, trust)
    model = _hf_model_of(name, state)
    temporary = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        model.save_pretrained(temporary, safe_serialization=True)
        if is_hf_model(name):
            for file in TOKENIZER_FILES:
                if (hf_dir(name) / file).is_file() and not (temporary / file).exists():
                    shutil.copyfile(hf_dir(name) / file, temporary / file)
        _sync_files(temporary)
        os.replace(temporary, out)  # onto an empty directory or none: _check_out made sure
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    sync_directory(out.parent)
    return model


def _hf_model_of(name: str, state: dict[str, torch.Tensor]) -> nn.Module:
    if is_hf_model(name):
        model = hf_causal_lm(name, hf_config(name), with_weights=False)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise UserError(f"model {name!r}", f"its config.json no longer fits the checkpoint's weights "
                            f"({str(exc).strip().splitlines()[0]})",
                            "export with the config.json the run trained with") from None
        return model
    transformers = transformers_module(f"--format hf for model {name!r}")
    return gpt2_model(transformers, gpt2_state(state), GPT2_EXPORTS[name])


def _check_out(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise UserError(f"--out {str(out)!r}", "already exists" + ("" if out.is_dir() else " and is not a directory"),
                        "choose a new directory (the export never overwrites one)")
    out.parent.mkdir(parents=True, exist_ok=True)


def _sync_files(directory: Path) -> None:
    """Every file on disk, readable as the umask allows (safetensors writes 0600, through a temporary file)."""
    umask = os.umask(0o022)
    os.umask(umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    sync_directory(directory)

