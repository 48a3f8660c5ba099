"""Language models: the GPT module, token windows, the pydoc and tokens datasets, their figures and bad input.

One module-scoped set of real 2-rank gloo runs (nodescale's launcher) on a ``tokens`` directory cut
from the pydoc corpus serves the strategy equivalences, the batch split, the resume and the
figures; everything else runs in this process. Big models are built on the meta device.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import final_weights, max_difference, read_metrics, read_summary, run_cli
from nodescale.config.load import load_config
from nodescale.config.schema import DataSection, ModelSection
from nodescale.data.pydoc import FORMAT as PYDOC
from nodescale.data.pydoc import corpus_bytes
from nodescale.data.token_windows import TokenWindows
from nodescale.data.tokens import FORMAT as TOKENS
from nodescale.errors import UserError
from nodescale.models.gpt import GPT, GPTShape
from nodescale.models.introspect import repeated_blocks, training_flops_per_sample
from nodescale.models.registry import build_model
from nodescale.models.spec import InputSpec
from nodescale.train.loss import correct, per_sample_loss

SEQ_LEN = 32
BYTES = 256


def lm_spec(seq_len: int, vocab: int) -> InputSpec:
    return InputSpec((seq_len,), vocab, "language_modeling")


def unigram_loss(cfg: DataSection) -> float:
    """The validation loss of a model that knows only the training bytes' frequencies (add-one smoothed)."""
    splits = PYDOC.load(cfg, seed=0)
    train, val = (split.get_batch(torch.arange(len(split)), torch.device("cpu"))[1].flatten()
                  for split in (splits.train, splits.val))
    frequencies = (torch.bincount(train, minlength=BYTES) + 1) / (len(train) + BYTES)
    return float(-frequencies[val].log().mean())


# --- the model ---------------------------------------------------------------------------------------


def test_big_presets_have_the_parameters_their_shapes_give() -> None:
    """gpt2_medium and llama_1b on the meta device, against the closed-form count of their shapes."""
    def gpt2(layers: int, d: int, vocab: int, positions: int) -> int:
        block = 2 * 2 * d + (4 * d * d + 4 * d) + (d * 4 * d + 4 * d) + (4 * d * d + d)  # norms, q k v o, MLP
        return vocab * d + positions * d + layers * block + 2 * d  # tied output layer: counted once

    def llama(layers: int, d: int, heads: int, kv_heads: int, hidden: int, vocab: int) -> int:
        kv = d // heads * kv_heads
        block = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * hidden
        return vocab * d + layers * block + d

    with torch.device("meta"):
        medium = build_model(ModelSection(name="gpt2_medium"), lm_spec(1024, 50257))
        llama_1b = build_model(ModelSection(name="llama_1b"), lm_spec(2048, 128256))
    assert sum(p.numel() for p in medium.parameters()) == gpt2(24, 1024, 50304, 1024)  # 50257 padded to 64
    assert sum(p.numel() for p in llama_1b.parameters()) == llama(16, 2048, 32, 8, 8192, 128256) == 1_235_814_400
    assert len(repeated_blocks(medium)) == 24 and len(repeated_blocks(llama_1b)) == 16  # FSDP and checkpoint units


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_a_token_sees_only_the_tokens_before_it(flavour: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTShape(layers=2, dim=32, heads=4, flavour=flavour, kv_heads=2), vocab_size=70, seq_len=12).eval()
    tokens = torch.randint(0, 70, (2, 12))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 70
    logits, logits_changed = model(tokens), model(changed)
    assert logits.shape == (2, 12, 128)  # 70 ids padded to a multiple of 64
    assert torch.equal(logits[:, :7], logits_changed[:, :7])
    assert not torch.allclose(logits[:, 7:], logits_changed[:, 7:])


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_flop_counter_agrees_with_6n_plus_attention(flavour: str) -> None:
    model = GPT(GPTShape(layers=3, dim=64, heads=4, flavour=flavour, kv_heads=2), vocab_size=100, seq_len=48)
    counted = training_flops_per_sample(model, lm_spec(48, 100)) / 48
    assert counted == pytest.approx(model.estimated_training_flops_per_token(48), rel=1e-3)
    assert model.output.weight is model.tok_embeddings.weight  # tied by default


def test_the_loss_is_the_mean_token_cross_entropy_and_accuracy_the_share_of_right_tokens() -> None:
    torch.manual_seed(0)
    logits, target = torch.randn(3, 5, 64), torch.randint(0, 50, (3, 5))
    losses = per_sample_loss(logits, target, "language_modeling")
    assert losses.shape == (3,)
    assert losses.mean().item() == pytest.approx(F.cross_entropy(logits.flatten(0, 1), target.flatten()).item())
    right = correct(logits, target, "language_modeling")
    assert right.mean().item() == pytest.approx((logits.argmax(-1) == target).float().mean().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_give_the_fp32_loss_and_a_gradient_of_their_own_dtype(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 64) * 4).to(dtype).requires_grad_()
    target = torch.randint(0, 64, (3, 5))
    losses = per_sample_loss(logits, target, "language_modeling")  # read as they are, not copied to fp32 first
    exact = F.cross_entropy(logits.detach().double().flatten(0, 1), target.flatten(), reduction="none").view(3, 5)
    assert losses.dtype == torch.float32
    # fp32 sums of 64 exponentials: a few units of fp32's last place, far inside 1e-5
    assert torch.allclose(losses.double(), exact.mean(dim=1), rtol=1e-5, atol=0)
    (grad,) = torch.autograd.grad(losses.sum(), logits)
    assert grad.dtype == dtype


def test_a_sequence_longer_than_the_context_is_refused() -> None:
    with pytest.raises(UserError) as error, torch.device("meta"):
        build_model(ModelSection(name="gpt2_small"), lm_spec(1025, 50257))
    assert "--seq-len 1025" in str(error.value) and "context of 1024" in str(error.value)
    assert "--seq-len 1024 or less" in str(error.value)


# --- token windows and data --------------------------------------------------------------------------


def test_windows_make_every_token_after_the_first_a_target_once(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.uint16) % 300
    tokens.tofile(tmp_path / "t.bin")
    mapped = TokenWindows(np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r"), 32)
    in_memory = TokenWindows(torch.from_numpy(tokens.astype(np.int32)), 32)
    assert len(mapped) == len(in_memory) == 999 // 32
    every = torch.arange(len(mapped))
    x, y = mapped.get_batch(every, torch.device("cpu"))
    assert x.dtype == y.dtype == torch.int64 and x.shape == (31, 32)
    assert torch.equal(y.flatten(), torch.from_numpy(tokens[1:31 * 32 + 1].astype(np.int64)))
    assert torch.equal(x[:, 1:], y[:, :-1])  # each target is the token after its input
    assert all(torch.equal(a, b) for a, b in zip(in_memory.get_batch(every, torch.device("cpu")), (x, y), strict=True))
    assert torch.equal(mapped[5][1], y[5])


def test_pydoc_splits_at_a_window_boundary_and_shares_no_target() -> None:
    data = corpus_bytes()
    splits = PYDOC.load(DataSection(name="pydoc", seq_len=SEQ_LEN, val_fraction=0.2), seed=0)
    assert splits.spec == lm_spec(SEQ_LEN, BYTES)
    assert abs(len(splits.val) / (len(splits.train) + len(splits.val)) - 0.2) < 0.01
    _, train_targets = splits.train.get_batch(torch.arange(len(splits.train)), torch.device("cpu"))
    _, val_targets = splits.val.get_batch(torch.arange(len(splits.val)), torch.device("cpu"))
    targets = torch.cat([train_targets.flatten(), val_targets.flatten()])
    expected = torch.frombuffer(bytearray(data), dtype=torch.uint8)[1:len(targets) + 1].long()
    assert torch.equal(targets, expected)  # in order, none twice, none left out but the tail


def write_tokens(root: Path, train: np.ndarray, val: np.ndarray) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    train.tofile(root / "train.bin")
    val.tofile(root / "val.bin")
    return root


def test_token_files_are_mapped_with_their_vocabulary(tmp_path: Path) -> None:
    root = write_tokens(tmp_path / "tok", np.arange(400, dtype=np.uint32), np.arange(100, dtype=np.uint32))
    (root / "meta.json").write_text(json.dumps({"vocab_size": 400}))
    splits = TOKENS.load(DataSection(name="tokens", dir=root, token_dtype="uint32", seq_len=16), seed=0)
    assert splits.spec == lm_spec(16, 400) and len(splits.train) == 399 // 16 and len(splits.val) == 99 // 16
    assert isinstance(splits.train.tokens, np.memmap)  # read where it is, not into memory
    assert DataSection(name="tokens", dir=root).seq_len == 1024  # the dataset's own default


@pytest.mark.parametrize(("case", "words"), [
    ("ids at or above the vocabulary", ["token id 256 at position 256", "vocabulary size 256", "data.vocab_size"]),
    ("a file of half a token", ["(601 bytes)", "whole number of uint16 tokens", "data.token_dtype"]),
    ("no val.bin", ["val.bin", "does not exist", "train.bin and val.bin"]),
    ("uint32 without a vocabulary", ["uint32 tokens without a vocabulary size", "data.vocab_size"]),
])
def test_bad_token_files_are_refused_with_the_value_the_rule_and_a_hint(tmp_path: Path, case: str,
                                                                        words: list[str]) -> None:
    fields: dict[str, object] = {"vocab_size": 256}
    root = write_tokens(tmp_path / "tok", np.arange(400, dtype=np.uint16) % 256, np.arange(100, dtype=np.uint16))
    if case == "ids at or above the vocabulary":
        np.arange(400, dtype=np.uint16).tofile(root / "train.bin")
    elif case == "a file of half a token":
        (root / "train.bin").write_bytes(b"\0" * 601)
    elif case == "no val.bin":
        (root / "val.bin").unlink()
    else:
        fields = {"token_dtype": "uint32"}
    with pytest.raises(UserError) as error:
        TOKENS.check(DataSection(name="tokens", dir=root, seq_len=16, **fields))
    assert all(word in str(error.value) for word in words), str(error.value)


def test_the_cli_refuses_missing_token_files_with_exit_code_2(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = run_cli(["train", "--model", "gpt_nano", "--dataset", "tokens", "--data-dir", "empty"], cwd=tmp_path,
                     check=False)
    assert result.returncode == 2 and "train.bin" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


# --- learning -----------------------------------------------------------------------------------------


def test_a_short_run_on_pydoc_learns_more_than_byte_frequencies(tmp_path: Path) -> None:
    """Clearly below what byte frequencies alone give (computed here: the corpus differs between Pythons)."""
    from nodescale.train.run import run_training

    cfg = load_config(None, {"model.name": "gpt_nano", "data.name": "pydoc", "data.val_fraction": 0.05,
                             "strategy.name": "single", "train.batch_size": 32, "train.max_steps": 60,
                             "optim.lr": 0.01, "optim.schedule": "constant", "train.progress": False,
                             "checkpoint.at_end": False,
                             "out": str(tmp_path / "run")})
    summary = run_training(cfg)
    frequencies_only = unigram_loss(cfg.data)  # about 3.2 nats per byte on Python 3.11
    assert summary["val_loss"] < frequencies_only - 0.3, (summary["val_loss"], frequencies_only)
    assert summary["val_perplexity"] == pytest.approx(math.exp(summary["val_loss"]))
    assert 0.05 < summary["val_accuracy"] < 1  # next-token accuracy, over every validation window
    assert summary["seq_len"] == 64  # pydoc's default


def test_pydoc_brings_its_own_default_epochs_and_a_setting_wins() -> None:
    """Three epochs keep the default `--dataset pydoc` run under two minutes on 2 CPU cores."""
    assert load_config(None, {"model.name": "gpt_nano", "data.name": "pydoc"}).train.epochs == 3
    assert load_config(None, {"model.name": "gpt_nano", "data.name": "pydoc", "train.epochs": 10}).train.epochs == 10
    assert load_config(None, {}).train.epochs == 10  # digits keeps the global default


# --- the strategies, on 2 gloo ranks -----------------------------------------------------------------

# SGD at a constant rate: differences between runs stay the size of float rounding (Adam would rescale
# them). The tokens directory is cut from the pydoc corpus: 1,535 training windows, 127 validation ones.
RUN = ["train", "--model", "gpt_nano", "--dataset", "tokens", "--data-dir", "tok", "--set", "data.vocab_size=256",
       "--seq-len", str(SEQ_LEN), "--max-steps", "6", "--optimizer", "sgd", "--lr", "0.05", "--set",
       "optim.schedule=constant", "--seed", "3", "--no-progress", "--log-every", "2"]
DDP = [*RUN, "--nproc", "2", "--batch-size", "8", "--checkpoint-every", "3", "--keep-last", "5"]
# FSDP and ZeRO-3 reduce-scatter the gradient sums DDP all-reduces, and one rank sums a batch DDP splits
# in two: the same values added in another order. After 6 SGD steps that leaves differences of order
# 1e-7 (float32 rounding of values near 1, times the steps); the tolerance leaves room for other CPUs.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """gpt_nano 6 steps: DDP 2 x 8 (checkpoints at 3 and 6), FSDP and ZeRO-3 likewise, 1 x 16, DDP resumed at 3."""
    root = tmp_path_factory.mktemp("language-models")
    corpus = np.frombuffer(corpus_bytes(), dtype=np.uint8).astype(np.uint16)
    write_tokens(root / "tok", corpus[:1535 * SEQ_LEN + 1], corpus[50_000:50_000 + 127 * SEQ_LEN + 1])
    partition_all = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}  # shard every parameter
    (root / "partition_all.json").write_text(json.dumps(partition_all))
    run_cli([*DDP, "--out", "ddp"], cwd=root)
    run_cli([*RUN, "--nproc", "2", "--batch-size", "8", "--strategy", "fsdp", "--out", "fsdp"], cwd=root)
    run_cli([*RUN, "--nproc", "2", "--batch-size", "8", "--strategy", "deepspeed", "--zero-stage", "3",
             "--deepspeed-config", "partition_all.json", "--out", "zero3"], cwd=root)
    run_cli([*RUN, "--nproc", "1", "--batch-size", "16", "--out", "one"], cwd=root)
    (root / "resumed" / "checkpoints").mkdir(parents=True)
    for path in (root / "ddp" / "checkpoints").glob("step-00000003*"):  # mid-epoch: 96 steps per epoch
        shutil.copy(path, root / "resumed" / "checkpoints")
    resumed = run_cli([*DDP, "--out", "resumed", "--resume"], cwd=root)
    assert "resumed from" in resumed.stdout and "(step 3)" in resumed.stdout
    return {path.name: path for path in root.iterdir()}


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_sharded_strategies_end_with_the_weights_of_ddp(lm_runs: dict[str, Path], strategy: str) -> None:
    assert max_difference(final_weights(lm_runs[strategy]), final_weights(lm_runs["ddp"])) < TOLERANCE
    assert read_summary(lm_runs[strategy])["val_samples"] == 127  # every validation window once


@pytest.mark.multiproc
def test_two_ranks_of_half_the_batch_equal_one_rank_of_all_of_it(lm_runs: dict[str, Path]) -> None:
    assert max_difference(final_weights(lm_runs["ddp"]), final_weights(lm_runs["one"])) < TOLERANCE


@pytest.mark.multiproc
def test_a_resume_mid_epoch_ends_bit_for_bit_where_the_run_ended(lm_runs: dict[str, Path]) -> None:
    assert max_difference(final_weights(lm_runs["resumed"]), final_weights(lm_runs["ddp"])) == 0.0
    assert read_summary(lm_runs["resumed"])["global_steps"] == 6


@pytest.mark.multiproc
def test_tokens_per_second_perplexity_and_flops_are_reported(lm_runs: dict[str, Path]) -> None:
    summary = read_summary(lm_runs["ddp"])
    assert summary["seq_len"] == SEQ_LEN and summary["val_samples"] == 127
    # Every rank's real samples, over the slowest rank's time: 2 ranks x 8 windows x 32 tokens per step.
    assert summary["timed_samples"] == 16 * summary["timed_steps"]
    seconds = summary["step_seconds"] * summary["timed_steps"]
    assert summary["tokens_per_second"] == pytest.approx(summary["timed_samples"] * SEQ_LEN / seconds, rel=1e-9)
    assert summary["val_perplexity"] == pytest.approx(math.exp(summary["val_loss"]), rel=1e-12)
    assert summary["mfu"] is None  # no peak for a CPU in bench/peaks.yaml
    assert summary["training_flops_per_token"] == pytest.approx(summary["estimated_training_flops_per_token"],
                                                                rel=1e-3)
    steps = [r for r in read_metrics(lm_runs["ddp"]) if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [2, 4, 6]
    assert all(r["tokens_per_second"] == pytest.approx(r["samples_per_second"] * SEQ_LEN) for r in steps)
    assert all(0 <= r["accuracy"] <= 1 and "mfu" in r for r in steps)
    header = (lm_runs["ddp"] / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "tokens_per_second" in header and "val_perplexity" in header


@pytest.mark.multiproc
def test_the_report_shows_tokens_per_second_and_perplexity_beside_a_classifier(
        lm_runs: dict[str, Path], tmp_path: Path) -> None:
    from nodescale.report.build import build_report
    from nodescale.report.run_section import summary_rows

    summary = read_summary(lm_runs["ddp"])
    report = build_report([lm_runs["ddp"], lm_runs["one"]], tmp_path / "report").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| throughput, all ranks (tokens/s)"))
    assert f"{summary['tokens_per_second']:,.1f}" in row
    assert "validation perplexity" in report
    classifier = {"world_size": 1, "samples_per_second": 10.0, "mfu": None}
    labels = [row[0] for row in summary_rows([classifier])]
    assert "throughput, all ranks (samples/s)" in labels and not any("tokens" in label for label in labels)
