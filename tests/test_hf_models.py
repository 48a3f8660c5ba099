"""Hugging Face models offline: ``--model hf:DIR`` and ``checkpoint export --format hf``.

A tiny Llama (2 layers, 32 wide, 4 heads in 2 key-value groups, 64 tokens, 32 positions,
tied embeddings) is written here with save_pretrained, weights included: nothing is
downloaded. One 2-rank FSDP run with activation checkpointing trains it on a user's token
dataset, exports it, and the export reloads with the logits of the trained model. Bad
input runs in-process, one ``main`` call each.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import cli_env, final_weights, read_summary, run_cli
from nodescale.cli.main import main
from nodescale.config.load import load_config
from nodescale.engine import checkpoint_files
from nodescale.models.activation_checkpointing import apply_activation_checkpointing
from nodescale.models.gpt import GPT, GPTShape
from nodescale.models.hf_gpt2 import gpt2_state
from nodescale.models.introspect import repeated_blocks, unwrap
from nodescale.models.registry import build_model
from nodescale.models.spec import InputSpec
from nodescale.train.loss import per_sample_loss
from required import require_module

transformers = require_module("transformers", "every Hugging Face model test")

SEQ_LEN, VOCAB = 16, 64
TOKENS = '''
import torch

def tokens(seq_len=16, count=64):
    """(ids, next ids) windows of a fixed stream: 48 to train on, 16 to validate."""
    stream = torch.arange(count * seq_len + 1) * 5 % 61
    pairs = [(stream[i * seq_len:(i + 1) * seq_len], stream[i * seq_len + 1:(i + 1) * seq_len + 1])
             for i in range(count)]
    return pairs[:48], pairs[48:]
'''


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny/``: config.json + model.safetensors of the tiny Llama; ``tokens.py``: the dataset."""
    root = tmp_path_factory.mktemp("hf")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)
    torch.manual_seed(11)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "tiny")
    (root / "tokens.py").write_text(TOKENS)
    return root


def build(code: Path) -> torch.nn.Module:
    """The model ``hf:tiny`` names, as every rank of a run builds it."""
    cfg = load_config(None, {"model.name": f"hf:{code / 'tiny'}", "data.name": f"{code / 'tokens.py'}:tokens"})
    return build_model(cfg.model, InputSpec((SEQ_LEN,), 0, "language_modeling"))


def test_the_model_takes_token_ids_and_gives_logits_under_hugging_faces_names(code: Path) -> None:
    model = build(code)
    saved = transformers.AutoModelForCausalLM.from_pretrained(code / "tiny").eval()
    assert type(unwrap(model)) is transformers.LlamaForCausalLM
    assert model.state_dict().keys() == saved.state_dict().keys()  # no prefix: checkpoints use HF's names
    assert all(torch.equal(value, saved.state_dict()[key]) for key, value in model.state_dict().items())  # weights
    ids = torch.randint(0, VOCAB, (3, SEQ_LEN))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids), saved(ids).logits)  # same class, weights, sdpa: the same arithmetic
    assert repeated_blocks(model) == list(unwrap(model).model.layers)  # the decoder layers: FSDP's units
    assert apply_activation_checkpointing(model, "hf:tiny") == 2


OFFLINE = r'''
import json, socket, sys
from nodescale.config.load import load_config
cfg = load_config(None, {"model.name": "hf:tiny", "data.name": "tokens.py:tokens"})
validated = {name: name in sys.modules for name in ("torch", "transformers")}
attempts = []
def refuse(*args, **kwargs):
    attempts.append(repr(args[:2]))
    raise OSError("no network in this test")
socket.socket.connect = socket.create_connection = socket.getaddrinfo = refuse
from nodescale.models.registry import build_model
from nodescale.models.spec import InputSpec
model = build_model(cfg.model, InputSpec((16,), 0, "language_modeling"))
total = sum(float(p.detach().double().sum()) for p in model.parameters())
print(json.dumps({"validated": validated, "attempts": attempts, "total": total}))
'''


def test_nothing_is_imported_to_validate_and_nothing_fetched_to_build(code: Path) -> None:
    env = {**cli_env(), "HF_HOME": str(code / "empty-hf-home")}  # no cache to fall back on
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)  # offline by nodescale's own calls, not by the environment
    result = subprocess.run([sys.executable, "-c", OFFLINE], cwd=code, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["validated"] == {"torch": False, "transformers": False}
    assert report["attempts"] == []
    saved = transformers.AutoModelForCausalLM.from_pretrained(code / "tiny")
    assert report["total"] == sum(float(p.detach().double().sum()) for p in saved.parameters())  # DIR's weights, loaded


@pytest.fixture(scope="module")
def run(code: Path) -> Path:
    """6 AdamW steps of 2 x 8 sequences under FSDP on 2 gloo ranks, blocks recomputed; exported as hf."""
    run_cli(["train", "--model", "hf:tiny", "--dataset", "tokens.py:tokens", "--strategy", "fsdp", "--nproc", "2",
             "--batch-size", "8", "--max-steps", "6", "--activation-checkpointing", "--no-progress", "--out", "run"],
            cwd=code)
    assert main(["checkpoint", "export", str(code / "run"), "--format", "hf", "--out", str(code / "export")]) == 0
    return code


@pytest.mark.multiproc
def test_an_fsdp_trained_model_exports_and_reloads_with_its_logits(run: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    summary = read_summary(run / "run")
    assert summary["strategy"] == "fsdp" and summary["global_steps"] == 6 and 0 <= summary["val_accuracy"] <= 1
    assert sorted(p.name for p in (run / "export").iterdir()) == ["config.json", "generation_config.json",
                                                                  "model.safetensors"]
    assert not list(run.glob(".export.tmp-*"))  # written aside, renamed into place
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(run / "export").eval()
    assert type(reloaded) is transformers.LlamaForCausalLM and reloaded.config._attn_implementation == "sdpa"
    trained = build(run).eval()
    trained.load_state_dict(final_weights(run / "run"))
    assert not torch.equal(trained.state_dict()["model.norm.weight"], torch.ones(32))  # it did train
    namespace: dict[str, Any] = {}
    exec(TOKENS, namespace)
    ids, targets = (torch.stack(part) for part in zip(*namespace["tokens"]()[1], strict=True))
    with torch.no_grad():
        logits = reloaded(ids).logits
        # The same fp32 operations in the same order on the same weights: equal to the last bit.
        assert torch.equal(logits, trained(ids))
        # The run's own validation loss: the same per-sample losses (to fp32 rounding: its ranks multiplied
        # batches of 8, not 16) summed in another order, in fp64.
        loss = per_sample_loss(logits, targets, "language_modeling").double().mean().item()
    assert loss == pytest.approx(summary["val_loss"], rel=1e-5)
    capsys.readouterr()
    assert main(["checkpoint", "export", str(run / "run"), "--format", "hf", "--out", str(run / "export")]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "the export never overwrites one" in err


@pytest.mark.parametrize("tie_weights", [True, False])
def test_a_builtin_gpt2_exports_as_gpt2lmheadmodel_with_its_logits(tie_weights: bool, tmp_path: Path) -> None:
    """gpt2_small's export settings on a tiny GPT-2 flavoured GPT (12 heads of 4), every weight random: through
    the CLI from a checkpoint of the engine's format, and back with from_pretrained."""
    torch.manual_seed(5)
    builtin = GPT(GPTShape(layers=2, dim=48, heads=12, context=SEQ_LEN), vocab_size=100, seq_len=SEQ_LEN,
                  tie_weights=tie_weights).eval()
    with torch.no_grad():
        for parameter in builtin.parameters():  # norms and biases too, not their ones and zeros
            parameter.normal_(0.0, 0.3)
    state = gpt2_state(builtin.state_dict())
    assert state["transformer.h.1.attn.c_attn.weight"].shape == (48, 3 * 48)  # q, k, v fused; Conv1D: (in, out)
    assert state["transformer.wte.weight"].shape == (128, 48)  # the padded vocabulary
    checkpoint_files.save(tmp_path / "run", 1, {"config": {"model": {"name": "gpt2_small"}},
                                                "model": builtin.state_dict()}, keep_last=1)
    assert main(["checkpoint", "export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(exported) is transformers.GPT2LMHeadModel
    assert (exported.lm_head.weight is exported.transformer.wte.weight) == tie_weights
    ids = torch.randint(0, 128, (3, SEQ_LEN))
    with torch.no_grad():
        expected, logits = builtin(ids), exported(ids).logits
    # Conv1D is addmm(b, x, W) where nn.Linear is x @ W.T + b: the same products, possibly summed in another
    # order or with the bias added at another point, so equal to float32 rounding of values of this size.
    assert logits.abs().max() > 1.0  # the logits' scale the tolerance is relative to
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    with pytest.raises(ValueError, match="has no GPT-2 name"):
        gpt2_state({"blocks.0.qkv.weight": torch.zeros(1)})


# --- bad input: exit code 2, the value, the rule and a hint -------------------------------------------------

def train(code: Path, *flags: str) -> list[str]:
    return ["train", "--dataset", "tokens.py:tokens", *flags, "--strategy", "single", "--max-steps", "1",
            "--no-progress", "--out", str(code / "bad-runs" / str(len(flags)) / flags[-1].replace("/", "_"))]


@pytest.fixture(scope="module")
def directories(code: Path) -> Path:
    """Broken hf: directories beside the good one, a cnn run and a gpt_nano checkpoint to export."""
    (code / "no-config").mkdir()
    (code / "no-config" / "model.safetensors").write_bytes(b"")
    for name, config in (("unknown", {"model_type": "no-such-architecture"}),
                         ("vit", transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                        intermediate_size=32).to_dict())):
        (code / name).mkdir()
        (code / name / "config.json").write_text(json.dumps(config))
    (code / "bin-only").mkdir()
    (code / "bin-only" / "config.json").write_text((code / "tiny" / "config.json").read_text())
    (code / "bin-only" / "pytorch_model.bin").write_bytes(b"")
    assert main(["train", "--model", "cnn", "--strategy", "single", "--max-steps", "1", "--no-progress",
                 "--out", str(code / "cnn")]) == 0
    checkpoint_files.save(code / "nano", 1, {"config": {"model": {"name": "gpt_nano"}}, "model": {}}, keep_last=1)
    return code


BAD = {  # name: (argv after the run's directory is known, what stderr says)
    "no_directory": (lambda c: train(c, "--model", "hf:gone"),
                     ["directory 'gone' does not exist", "never downloads"]),
    "no_config": (lambda c: train(c, "--model", "hf:no-config"),
                  ["holds no config.json", "it holds: model.safetensors"]),
    "unknown_architecture": (lambda c: train(c, "--model", "hf:unknown"),
                             ["cannot build", "no-such-architecture", "hint: name a model_type transformers knows"]),
    "not_a_causal_lm": (lambda c: train(c, "--model", "hf:vit"), ["'vit' is not a causal language model"]),
    "bin_weights": (lambda c: train(c, "--model", "hf:bin-only"),
                    ["its weights are in pytorch_model.bin, not in safetensors", "save_pretrained(NEW_DIR)"]),
    "too_long": (lambda c: train(c, "--model", "hf:tiny", "--set", "data.args.seq_len=33"),
                 ["sequence length 33: is longer than the context", "32 positions", "at most 32 tokens"]),
    "image_data": (lambda c: ["train", "--model", "hf:tiny", "--dataset", "digits", "--out", str(c / "digits")],
                   ["the model does language_modeling but the dataset is for classification"]),
    "export_cnn": (lambda c: ["checkpoint", "export", str(c / "cnn"), "--format", "hf", "--out", str(c / "cnn-hf")],
                   ["--format hf for model 'cnn': has no Hugging Face equivalent; these export: hf:DIR models",
                    "hint: export its state dict instead"]),
    "export_llama_flavour": (lambda c: ["checkpoint", "export", str(c / "nano"), "--format", "hf", "--out",
                                        str(c / "nano-hf")],
                             ["--format hf for model 'gpt_nano': has no Hugging Face equivalent",
                              "these export: hf:DIR models, gpt2_medium, gpt2_small"]),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_exits_2_with_the_value_the_rule_and_a_hint(name: str, directories: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(directories)
    argv, expected = BAD[name]
    assert main(argv(directories)) == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err, (text, err)
    assert "Traceback" not in err


def test_without_transformers_the_message_names_the_extra(code: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(code)
    monkeypatch.setitem(sys.modules, "transformers", None)  # what a missing package looks like to `import`
    assert main(train(code, "--model", "hf:tiny")) == 2
    err = capsys.readouterr().err
    assert "needs the Hugging Face transformers package" in err and "pip install 'nodescale[lm]'" in err
