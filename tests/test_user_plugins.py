"""Your own model, dataset and loss: ``--model``/``--dataset``/``--loss FILE.py:FN`` (or ``package.module:FN``).

Pure checks first (the launcher's ast reading, the spec of a first sample, the FSDP units'
rules, model outputs, losses, weights), then real runs that share their processes: DDP
against FSDP on a user's model, data and loss, with resume and export; a Hugging Face ViT
under FSDP; and every bad input, each ending with exit code 2 and a message, no traceback.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import cli_env, final_weights, max_difference, read_summary, run_cli, weights_as_saved
from nodescale.cli.main import main
from nodescale.config.load import load_config, with_absolute_inputs
from nodescale.data.user_dataset import Converted, derive_spec
from nodescale.errors import UserError
from nodescale.models.introspect import repeated_blocks
from nodescale.models.registry import build_model
from nodescale.models.spec import InputSpec
from nodescale.plugins.refs import check_ref, parse_ref
from nodescale.train.build_model import load_weights
from nodescale.train.loss import make_loss, model_output
from nodescale.train.rundir import default_run_dir
from required import require_module

USER_CODE = Path(__file__).parent / "user_code"  # user.py, bad.py, userpkg/vit.py
SGD = ["--optimizer", "sgd", "--lr", "0.05", "--set", "optim.schedule=constant", "--no-progress", "--seed", "3"]
TOLERANCE = 1e-5  # as tests/test_fsdp.py: FSDP reduce-scatters the sums DDP all-reduces


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of tests/user_code, plus trap/mod.py whose package must not be imported; runs write here too."""
    root = tmp_path_factory.mktemp("user-code") / "code"
    shutil.copytree(USER_CODE, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "trap").mkdir()
    (root / "trap" / "mod.py").write_text("def build(): pass\n")
    (root / "trap" / "__init__.py").write_text("raise RuntimeError('the launcher must not run a package')\n")
    return root


# --- the launcher's checks: read, never run -------------------------------------------------------


def test_the_launcher_reads_the_file_without_running_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        code: Path) -> None:
    source = "raise SystemExit('ran')\nimport os.path as osp\nx: int = 1\nif True:\n    def late(): pass\n" \
             "def build(): pass\nclass Net: pass\n"
    (tmp_path / "m.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    for name in ("build", "Net", "late", "x", "osp"):
        assert check_ref("model", f"m.py:{name}").function == name
    cases = {"m.py:biuld": ("defines no 'biuld'", "did you mean 'build'?"),
             "gone.py:build": ("does not exist", "relative paths start in"),
             "hf:/models/llama": ("only --model takes", "mycode.py:load"),  # a model's hf: is no code reference
             "m.py:not-a-name": ("must be FILE.py:FUNCTION", "mycode.py:build")}
    (tmp_path / "broken.py").write_text("def build(:\n")
    cases["broken.py:build"] = ("is not valid Python (line 1", "py_compile")
    for text, (rule, hint) in cases.items():
        with pytest.raises(UserError) as caught:
            check_ref("model", text)
        assert rule in caught.value.rule and hint in (caught.value.hint or ""), text
    # package.module:FN is found without importing the package (its __init__ raises)
    monkeypatch.syspath_prepend(str(code))
    assert check_ref("model", "trap.mod:build").target == "trap.mod"
    assert "trap" not in sys.modules
    assert "defines no 'make'" in str(pytest.raises(UserError, check_ref, "model", "trap.mod:make").value)
    assert "no module 'nopkg.mod'" in str(pytest.raises(UserError, check_ref, "model", "nopkg.mod:build").value)


def test_paths_are_stored_absolute_and_run_directories_named_safely(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my net.py").write_text("def build(): pass\ndef data(): pass\ndef loss(): pass\n")
    torch.save({}, tmp_path / "w.pt")
    cfg = with_absolute_inputs(load_config(None, {
        "model.name": "my net.py:build", "data.name": "my net.py:data", "train.loss": "my net.py:loss",
        "model.weights": "w.pt", "model.args.width": 8}))
    assert cfg.model.name == f"{tmp_path / 'my net.py'}:build" and cfg.train.loss.startswith(str(tmp_path))
    assert cfg.model.weights == tmp_path / "w.pt" and cfg.model.args == {"width": 8}
    assert default_run_dir(cfg).name.startswith("my_net-my_net-")
    with pytest.raises(UserError, match="model.args are the keyword arguments of your own function"):
        load_config(None, {"model.args.width": 8})  # a built-in model takes no arguments


# --- samples, spec, outputs, losses, weights --------------------------------------------------------


class Labelled(list):
    classes = ["a", "b", "c"]


def test_samples_are_converted_and_the_spec_comes_from_the_first() -> None:
    ref = parse_ref("dataset", "d.py:data")
    images = Converted(ref, Labelled([(np.zeros((1, 8, 8)), 2)] * 3), "train")
    x, y = images[0]
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and y.dim() == 0
    assert derive_spec(x, y, images.dataset) == InputSpec((1, 8, 8), 3, "classification")
    assert derive_spec(x, y, list(images.dataset)).num_classes == 0  # unknown: from the model's output width
    features = Converted(ref, [(torch.zeros(20), 1.5)], "train")
    x, y = features[0]
    assert y.shape == (1,) and derive_spec(x, y, features.dataset) == InputSpec((20,), 1, "regression")
    for bad, rule in (([torch.zeros(3)], "must be a pair (input, target)"),
                      ([(torch.zeros(3), torch.zeros(2, dtype=torch.long))], "must be a class index"),
                      ([(object(), 1)], "does not convert to a tensor")):
        with pytest.raises(UserError, match=rule.replace("(", r"\(").replace(")", r"\)")):
            Converted(ref, bad, "val")[0]


class Outer(nn.Module):
    def __init__(self, inner: bool = True) -> None:
        super().__init__()
        self.inner = Outer(False) if inner else nn.Linear(2, 2)


class HFStyle(nn.Module):
    _no_split_modules = ["Outer"]

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Outer(), Outer()
        self.heads = nn.ModuleList([nn.Linear(2, 2)] * 2)


class Listed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
        self.large = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))


def test_fsdp_units_are_named_declared_hugging_faces_or_the_largest_module_list() -> None:
    spec = InputSpec((1, 8, 8), 10)
    cnn = build_model(load_config(None, {}).model, spec)
    assert [type(b).__name__ for b in repeated_blocks(cnn)] == ["ConvBlock", "ConvBlock"]  # declared
    toy = load_config(None, {"model.name": "toy", "data.name": "regression"}).model
    assert repeated_blocks(build_model(toy, InputSpec((20,), 1, "regression"))) == []  # declared: none
    hf = HFStyle()
    assert repeated_blocks(hf) == [hf.a, hf.b]  # _no_split_modules, outermost only
    listed = Listed()
    assert repeated_blocks(listed) == list(listed.large)  # most parameters, not most items
    assert repeated_blocks(listed, ["Linear"]) == [*listed.small, *listed.large]  # strategy.fsdp_units wins
    with pytest.raises(UserError, match="no module of the model has these classes") as caught:
        repeated_blocks(listed, ["Block"])
    assert "Linear" in (caught.value.hint or "")
    transformers = require_module("transformers", "a Hugging Face model's FSDP units")
    vit = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=10))
    assert sorted(type(b).__name__ for b in repeated_blocks(vit)) == ["ViTEmbeddings", "ViTLayer", "ViTLayer"]
    assert model_output(vit(torch.zeros(2, 1, 8, 8))).shape == (2, 10)  # ImageClassifierOutput.logits


def test_model_outputs_and_losses() -> None:
    logits, target = torch.randn(4, 3), torch.tensor([0, 2, 1, 2])
    for output in (logits, SimpleNamespace(logits=logits), {"logits": logits}, (logits, "hidden")):
        assert model_output(output) is logits
    with pytest.raises(UserError, match="keys loss"):
        model_output({"loss": logits.sum()})
    expected = F.cross_entropy(logits, target, reduction="none")
    assert torch.equal(make_loss("auto", "classification")(logits, target), expected)
    assert torch.equal(make_loss("cross_entropy", "regression")(logits, target), expected)


def test_weights_load_strictly(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    torch.save(model.state_dict(), tmp_path / "w.pt")
    fresh = nn.Linear(3, 2)
    load_weights(fresh, tmp_path / "w.pt")
    assert torch.equal(fresh.weight, model.weight)
    with pytest.raises(UserError, match="does not fit the model"):
        load_weights(nn.Linear(3, 4), tmp_path / "w.pt")


# --- real runs ----------------------------------------------------------------------------------------


def torchrun(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "nodescale", *args], cwd=cwd, env=env or cli_env(), capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


@pytest.fixture(scope="module")
def runs(code: Path) -> Path:
    """user.py's model, data and loss for 8 SGD steps of 2 x 16: DDP, FSDP, and DDP resumed at step 4 on 1 rank."""
    args = ["train", "--model", "user.py:build", "--dataset", "user.py:digits", "--loss", "user.py:xent",
            "--set", "model.args.width=24", "--set", "model.args.depth=3", "--max-steps", "8", *SGD]
    run_cli([*args, "--nproc", "2", "--batch-size", "16", "--checkpoint-every", "4", "--out", "ddp"], cwd=code)
    torchrun([*args, "--strategy", "fsdp", "--batch-size", "16", "--out", "fsdp"], cwd=code)
    (code / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copy(code / "ddp/checkpoints/step-00000004.pt", code / "resumed/checkpoints/")
    run_cli([*args, "--strategy", "single", "--batch-size", "32", "--out", "resumed", "--resume"], cwd=code)
    assert main(["checkpoint", "export", str(code / "fsdp"), "--out", str(code / "fsdp.pt")]) == 0  # no processes
    return code


@pytest.mark.multiproc
def test_fsdp_trains_the_users_model_to_the_weights_of_ddp(runs: Path) -> None:
    ddp = final_weights(runs / "ddp")
    assert any(key.startswith("blocks.2.") for key in ddp)  # model.args reached the user's function
    assert max_difference(final_weights(runs / "fsdp"), ddp) < TOLERANCE
    summary = read_summary(runs / "fsdp")
    assert summary["strategy"] == "fsdp" and summary["global_steps"] == 8 and summary["val_samples"] == 359
    assert summary["val_accuracy"] > 0.3  # the user's loss trained it; evaluation read the dict's logits


@pytest.mark.multiproc
def test_a_users_run_resumes_and_exports_without_its_class(runs: Path) -> None:
    assert max_difference(final_weights(runs / "resumed"), final_weights(runs / "ddp")) < TOLERANCE
    config = (runs / "ddp" / "config.yaml").read_text()
    assert f"name: {runs / 'user.py'}:build" in config and "width: 24" in config
    exported = torch.load(runs / "fsdp.pt", weights_only=True)
    sys.path.insert(0, str(runs))
    try:
        import user  # the user's own class takes the exported state dict
    finally:
        sys.path.remove(str(runs))
    model = user.build(width=24, depth=3)
    model.load_state_dict(exported)
    saved = weights_as_saved(runs / "fsdp" / "checkpoints" / "step-00000008")  # read by DCP, not nodescale
    assert model.state_dict().keys() == saved.keys()
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)


@pytest.mark.multiproc
def test_a_hugging_face_vit_from_an_import_path_trains_under_fsdp(code: Path) -> None:
    require_module("transformers", "a Hugging Face ViT")
    env = {**cli_env(), "PYTHONPATH": str(code)}
    torchrun(["train", "--model", "userpkg.vit:build", "--strategy", "fsdp", "--max-steps", "3", "--batch-size",
              "8", "--out", "vit", *SGD], cwd=code, env=env)
    summary = read_summary(code / "vit")
    assert summary["strategy"] == "fsdp" and summary["global_steps"] == 3 and summary["val_samples"] == 359
    assert final_weights(code / "vit")["classifier.weight"].shape == (10, 32)


# --- bad input: exit code 2, the value, the rule and a hint, no traceback but the user's ----------------

RUNNER = '''
import contextlib, io, json, sys, traceback
from nodescale.cli.main import main

results = {}
for name, argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(["train", *argv, "--strategy", "single", "--max-steps", "1", "--no-progress", "--out", name])
        except BaseException:  # what `python -m nodescale` would print, then exit 1; the next case still runs
            traceback.print_exc()
            code = 1
    results[name] = {"code": code, "stderr": err.getvalue(), "torch": "torch" in sys.modules}
print(json.dumps(results))
'''

# name: (flags, what the message says). The first three fail in the launcher, before torch is imported.
BAD_INPUTS: dict[str, tuple[list[str], list[str]]] = {
    "missing_file": (["--model", "gone.py:build"], ["'gone.py' does not exist", "hint: check the path"]),
    "missing_function": (["--model", "user.py:biuld"], ["user.py defines no 'biuld'", "did you mean 'build'?"]),
    "hugging_face": (["--model", "hf:org/model"], ["directory 'org/model' does not exist", "never downloads"]),
    "raises": (["--model", "bad.py:raises"], ["raised ValueError: the widths do not add up (building the model)",
                                              'bad.py", line 13, in helper', "hint: fix bad.py at the line shown"]),
    "not_a_module": (["--model", "bad.py:not_a_module"], ["returned the class Linear: must return a torch.nn.Module",
                                                          "hint: return the model itself"]),
    "not_a_pair": (["--dataset", "bad.py:one_set"], ["returned a TensorDataset: must return a pair (train, val)",
                                                     "hint: end the function with"]),
    "wrong_shape": (["--model", "user.py:build", "--dataset", "bad.py:small_images"],
                    ["inputs of shape (1, 7, 7)", "refused them: raised RuntimeError", "user.py\", line",
                     "hint: make the dataset's inputs"]),
    "labels_out_of_range": (["--model", "user.py:build", "--dataset", "bad.py:far_labels"],
                            ["label 17 in the training set: is out of range for the model's 10 outputs",
                             "hint: give the model one output per class (at least 18)"]),
    "scalar_loss": (["--loss", "bad.py:scalar_loss"],
                    ["returned a tensor of shape () for a batch of 2", "one loss per sample",
                     "hint: compute it with reduction='none'"]),
    "no_blocks": (["--model", "bad.py:flat", "--activation-checkpointing"],
                  ["no repeated blocks to recompute", "hint: name its block class: --set strategy.fsdp_units="]),
    # Issue 36: mistakes that ended in torch's traceback, or in exit code 0 or 3 without a run.
    "no_parameters": (["--model", "bad.py:no_parameters"],
                      ["returned a Doubler without trainable parameters", 'bad.py", line 47, in no_parameters',
                       "hint: give the model layers with weights"]),
    "negative_length": (["--dataset", "bad.py:negative_length"],
                        ["the train set's __len__ returned -3: must be its number of samples",
                         'bad.py", line 52, in __len__', "hint: return the number of samples from Shrinking.__len__"]),
    "interrupted": (["--model", "bad.py:interrupted"],
                    ["was interrupted: KeyboardInterrupt (building the model)", 'bad.py", line 62, in interrupted',
                     "hint: a Ctrl-C stops it there"]),
    "exits_0": (["--model", "bad.py:exits"], ["called sys.exit(0) (building the model)", 'bad.py", line 68, in exits',
                                              "hint: return from exits() instead of exiting"]),
}


@pytest.fixture(scope="module")
def bad_runs(code: Path) -> dict[str, dict[str, Any]]:
    """Every bad input through the real CLI entry point, one after another in one process (torch loads once)."""
    cases = [[name, flags] for name, (flags, _) in BAD_INPUTS.items()]
    result = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(cases)], cwd=code, env=cli_env(),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_exits_2_with_the_value_the_rule_and_a_hint(bad_runs: dict[str, dict[str, Any]], name: str) -> None:
    run = bad_runs[name]
    assert run["code"] == 2, run
    for text in BAD_INPUTS[name][1]:
        assert text in run["stderr"], (text, run["stderr"])
    assert "Traceback" not in run["stderr"]
    assert "site-packages" not in run["stderr"] and "nodescale/" not in run["stderr"]  # only the user's frames


def test_the_launcher_checks_before_importing_torch(bad_runs: dict[str, dict[str, Any]]) -> None:
    assert [bad_runs[name]["torch"] for name in ("missing_file", "missing_function", "hugging_face")] == [False] * 3


@pytest.mark.multiproc
def test_every_rank_refuses_a_scalar_loss_and_the_launcher_says_it_once(code: Path) -> None:
    result = run_cli(["train", "--loss", "bad.py:scalar_loss", "--nproc", "2", "--max-steps", "1", "--out", "two"],
                     cwd=code, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("one loss per sample") == 1 and "(ranks 0, 1)" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.multiproc
def test_a_model_function_calling_sys_exit_3_is_a_user_error_not_a_stop_for_requeue(code: Path) -> None:
    """Exit code 3 is the requeue code (issue 30): the user's own sys.exit(3) is named, once, with exit code 2."""
    result = run_cli(["train", "--model", "bad.py:exits", "--set", "model.args.code=3", "--nproc", "2",
                      "--max-steps", "1", "--out", "exits"], cwd=code, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("called sys.exit(3) (building the model)") == 1, result.stderr
    assert "requeue" not in result.stderr and "Traceback" not in result.stderr
