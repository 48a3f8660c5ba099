"""DeepSpeed ZeRO (``--strategy deepspeed``): DDP's weights at every stage, its checkpoints, its config rules.

Every run is the real ``deepspeed`` engine in real processes on gloo, started
through the CLI by nodescale's launcher, torchrun or Open MPI's mpiexec. A
missing deepspeed fails these tests (CI installs it), it does not skip them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import cli_env, final_weights, free_port, max_difference, read_summary, run_cli
from nodescale.strategies.deepspeed import TAG, import_deepspeed
from test_fsdp import BF16_MODELS, Bf16Case, check_bf16_forwards, plain_model
from test_hardening import Payload, seal

pytestmark = pytest.mark.multiproc
pytest_plugins = ["shared_runs"]  # ddp_references: the DDP runs ZeRO must match, shared with test_fsdp.py

STAGES = (1, 2, 3)
# ZeRO reduce-scatters the gradient sums DDP all-reduces; on 2 gloo ranks the weights have come
# out bit for bit equal. The tolerance leaves room for another summation order.
TOLERANCE = 1e-5
# Stage 3 keeps parameters under 100k values whole on every rank (DeepSpeed's default persistence
# threshold); this file partitions every one, so the memory test sees real sharding.
PARTITION_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
# The LUMI seed config, its trailing comma included: nodescale must read it as it is.
LUMI_SEED_CONFIG = """{
  "zero_optimization": {
    "stage": 1
  },

  "fp16": {
    "enabled": false,
  }
}
"""


@pytest.fixture(scope="module")
def equivalence_runs(zero_equivalence_runs: dict[str, Path]) -> dict[str, Path]:
    """The DDP references, and each ZeRO stage on their commands (made once per session: tests/shared_runs.py)."""
    return zero_equivalence_runs


def mpiexec(args: list[str], cwd: Path) -> None:
    """``mpiexec -n 2 python -m nodescale ARGS`` (Open MPI's); fails the test if it fails."""
    result = subprocess.run(
        ["mpiexec.openmpi", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m", "nodescale",
         *args], cwd=cwd, env={**cli_env(), "MASTER_PORT": str(free_port())}, capture_output=True, text=True,
        timeout=240,
    )
    assert result.returncode == 0, f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


@pytest.mark.parametrize("model", ["cnn", "vit"])
@pytest.mark.parametrize("stage", STAGES)
def test_zero_ends_with_the_weights_of_ddp(equivalence_runs: dict[str, Path], model: str, stage: int) -> None:
    run_dir = equivalence_runs[f"{model}-zero{stage}"]
    assert max_difference(final_weights(run_dir), final_weights(equivalence_runs[f"{model}-ddp"])) < TOLERANCE
    summary = read_summary(run_dir)
    assert summary["strategy"] == "deepspeed" and summary["world_size"] == 2
    assert summary["val_samples"] == 359  # every rank took part in evaluation, every sample once


def test_zero3_shards_parameters_and_gradients(equivalence_runs: dict[str, Path]) -> None:
    ddp = read_summary(equivalence_runs["vit-ddp"])["state_bytes_per_rank"]
    zero3 = read_summary(equivalence_runs["vit-zero3"])["state_bytes_per_rank"]
    for kind in ("parameter_bytes", "gradient_bytes"):
        assert 0.45 * ddp[kind] < zero3[kind] < 0.55 * ddp[kind], (kind, ddp, zero3)
    # Optimiser: half the momentum plus half an fp32 master copy, which DDP does not keep.
    assert 0.9 * ddp["optimizer_bytes"] < zero3["optimizer_bytes"] < 1.1 * ddp["optimizer_bytes"]


def test_zero1_shards_the_optimizer_state_only(equivalence_runs: dict[str, Path]) -> None:
    ddp = read_summary(equivalence_runs["vit-ddp"])["state_bytes_per_rank"]
    zero1 = read_summary(equivalence_runs["vit-zero1"])["state_bytes_per_rank"]
    assert zero1["parameter_bytes"] >= ddp["parameter_bytes"]  # every rank keeps the whole model
    assert zero1["total_bytes"] < ddp["total_bytes"]


ARGS = ["train", "--strategy", "deepspeed", "--zero-stage", "2", "--max-steps", "8", "--batch-size", "16",
        "--grad-accum", "2", "--checkpoint-every", "4", "--keep-last", "5", "--no-progress"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO-2 on 2 ranks, AdamW with a cosine schedule, accumulation 2, checkpoints at steps 4 and 8."""
    root = tmp_path_factory.mktemp("deepspeed-resume")
    run_cli([*ARGS, "--nproc", "2", "--out", str(root / "saved")], cwd=root)
    return root / "saved"


def copy_step_4(run_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-00000004", tmp_path / "run" / "checkpoints" / "step-00000004")


def test_every_rank_writes_its_zero_partition(saved_run: Path) -> None:
    path = saved_run / "checkpoints" / "step-00000004"
    names = {f.name for f in (path / "deepspeed").iterdir()}
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= names
    trainer_state = torch.load(path / "trainer.pt", weights_only=True)
    assert trainer_state["layout"] == "deepspeed" and trainer_state["position"]["global_step"] == 4


def test_zero_resumed_on_the_same_ranks_ends_as_if_never_stopped(saved_run: Path, tmp_path: Path) -> None:
    copy_step_4(saved_run, tmp_path)
    result = run_cli([*ARGS, "--nproc", "2", "--out", "run", "--resume"], cwd=tmp_path)
    assert "(step 4)" in result.stdout
    assert max_difference(final_weights(tmp_path / "run"), final_weights(saved_run)) == 0.0


def test_zero_refuses_another_world_size_and_says_how_to_go_on(saved_run: Path, tmp_path: Path) -> None:
    copy_step_4(saved_run, tmp_path)
    result = run_cli([*ARGS, "--nproc", "1", "--batch-size", "32", "--out", "run", "--resume"], cwd=tmp_path,
                     check=False)
    assert result.returncode == 2, result.stderr
    assert "written by 2" in result.stderr and "checkpoint export" in result.stderr
    assert "Traceback" not in result.stderr


def test_fsdp_refuses_a_deepspeed_checkpoint_with_the_way_out(saved_run: Path, tmp_path: Path) -> None:
    copy_step_4(saved_run, tmp_path)
    args = [*ARGS[:1], *ARGS[5:], "--strategy", "fsdp", "--nproc", "2", "--out", "run", "--resume"]
    result = run_cli(args, cwd=tmp_path, check=False)
    assert result.returncode == 2 and "--strategy deepspeed" in result.stderr and "Traceback" not in result.stderr


def test_an_exported_zero_checkpoint_loads_into_the_plain_model(saved_run: Path, tmp_path: Path) -> None:
    run_cli(["checkpoint", "export", str(saved_run), "--out", "model.pt"], cwd=tmp_path)
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    config = torch.load(saved_run / "checkpoints" / "step-00000008" / "trainer.pt", weights_only=True)["config"]
    plain_model(config).load_state_dict(state)  # strict: every parameter and BatchNorm buffer
    info = json.loads(run_cli(["checkpoint", "info", str(saved_run), "--json"], cwd=tmp_path).stdout)
    assert info["layout"] == "deepspeed" and info["step"] == 8 and info["world_size"] == 2
    # The same values as DeepSpeed's own consolidation, which unpickles its files (a checkpoint of our own here).
    import_deepspeed("cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    reference = get_fp32_state_dict_from_zero_checkpoint(str(saved_run / "checkpoints" / "step-00000008"), tag=TAG)
    assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state)


@pytest.mark.parametrize("victim", ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt",
                                    "stage 0"])
def test_a_crafted_deepspeed_checkpoint_runs_no_code_on_export(saved_run: Path, tmp_path: Path, victim: str) -> None:
    """A checkpoint from elsewhere whose DeepSpeed file creates a file when unpickled, with a manifest to match."""
    checkpoint = tmp_path / "step-00000008"
    shutil.copytree(saved_run / "checkpoints" / "step-00000008", checkpoint)
    files = checkpoint / TAG
    if victim == "stage 0":  # no partitions: nodescale reads rank 0's model states itself
        for partition in files.glob("zero_pp_rank_*_optim_states.pt"):
            partition.unlink()
        victim = "mp_rank_00_model_states.pt"
    marker = tmp_path / "pwned"
    state = torch.load(files / victim, weights_only=False)  # written by our own run above
    torch.save({**state, "payload": Payload(marker)}, files / victim)
    seal(checkpoint)
    result = run_cli(["checkpoint", "export", str(checkpoint), "--out", "model.pt"], cwd=tmp_path, check=False)
    assert not marker.exists(), "checkpoint export ran code from the checkpoint"
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"checkpoint file {files / victim}: holds an object of io.open" in result.stderr
    assert "--trust-checkpoint" in result.stderr and not (tmp_path / "model.pt").exists()


def test_mpiexec_starts_deepspeed_ranks(equivalence_runs: dict[str, Path]) -> None:
    """Open MPI's mpiexec (vit-zero3): nodescale reads the ranks from OMPI_* and DeepSpeed reuses its process group."""
    summary = read_summary(equivalence_runs["vit-zero3"])
    assert summary["world_size"] == 2 and summary["strategy"] == "deepspeed" and summary["global_steps"] == 4


# BatchNorm: DeepSpeed's autocast; none: a bf16 engine (the vit on small data, as in test_fsdp.py)
@pytest.mark.parametrize("case", BF16_MODELS)
def test_zero_trains_in_bf16(case: Bf16Case, tmp_path: Path) -> None:
    run_cli(["train", "--strategy", "deepspeed", "--zero-stage", "3", "--precision", "bf16",
             *case.flags(tmp_path / "forwards"), "--batch-size", "8", "--max-steps", "3", "--no-progress", "--out",
             "run"], cwd=tmp_path)
    summary = read_summary(tmp_path / "run")
    assert summary["precision"] == "bf16" and summary["val_loss"] == pytest.approx(summary["val_loss"])  # not NaN
    check_bf16_forwards(tmp_path / "forwards", case, steps=3)  # bf16 weights from DeepSpeed's engine, or autocast


def test_the_lumi_seed_config_with_its_trailing_comma_runs(equivalence_runs: dict[str, Path]) -> None:
    run_dir = equivalence_runs["cnn-zero1"]  # trained with LUMI_SEED_CONFIG
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["strategy"]["deepspeed_config"].endswith("lumi.json")
    assert read_summary(run_dir)["global_steps"] == 8


@pytest.mark.parametrize(("config", "args", "message"), [
    ({"train_batch_size": 256}, [], "= 32 x 1 x 2 = 64"),
    ({"train_micro_batch_size_per_gpu": 16}, [], "pass --batch-size 16"),
    ({"zero_optimization": {"stage": 1}}, ["--zero-stage", "3"], "disagree"),
    ({"bf16": {"enabled": True}}, [], "pass --precision bf16"),
    ({"optimizer": {"type": "Adam"}}, [], "remove the 'optimizer' section"),
    ("{ not json", [], "line 1, column 3"),
])
def test_a_contradicting_deepspeed_config_is_refused_before_any_process_starts(
        config: object, args: list[str], message: str, tmp_path: Path) -> None:
    text = config if isinstance(config, str) else json.dumps(config)
    (tmp_path / "ds.json").write_text(text)
    result = run_cli(["train", "--strategy", "deepspeed", "--nproc", "2", "--deepspeed-config", "ds.json", *args,
                      "--out", "run"], cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--cpu-offload", "optimizer"], "without GPUs"),
    (["--zero-stage", "0", "--cpu-offload", "optimizer"], "from stage 1 on"),
    (["--sync-batchnorm"], "--sync-batchnorm applies to --strategy ddp or fsdp"),
    (["--zero-stage", "2", "--cpu-offload", "all"], "use --zero-stage 3"),
    (["--zero-stage", "4"], "zero_stage"),
    (["--compile"], "drop --compile"),
    (["--checkpoint-format", "full"], "nodescale checkpoint export"),
])
def test_impossible_deepspeed_settings_are_user_errors(args: list[str], message: str, tmp_path: Path) -> None:
    result = run_cli(["train", "--strategy", "deepspeed", "--max-steps", "1", *args, "--out", "run"], cwd=tmp_path,
                     check=False)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_the_generated_config_follows_the_run() -> None:
    from nodescale.strategies.deepspeed_config import build_config

    def build(**changes: object) -> dict:
        options = {"micro_batch": 8, "grad_accum": 4, "world_size": 16, "precision": "bf16", "zero_stage": None,
                   "grad_clip": None, "cpu_offload": "none", "has_batchnorm": False, **changes}
        return build_config(None, **options)

    config = build()
    assert config["train_batch_size"] == 8 * 4 * 16 and config["zero_optimization"]["stage"] == 2
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert config["gradient_clipping"] == 0.0  # DeepSpeed's own default would clip at 1.0
    assert build(has_batchnorm=True)["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert build(has_batchnorm=True)["bf16"] == {"enabled": False}
    assert build(grad_clip=0.5)["gradient_clipping"] == 0.5
    offloaded = build(zero_stage=3, cpu_offload="all")["zero_optimization"]
    assert offloaded["offload_param"]["device"] == "cpu" and offloaded["offload_optimizer"]["device"] == "cpu"
    assert build(zero_stage=3, cpu_offload="all")["zero_force_ds_cpu_optimizer"] is False  # nodescale's optimiser
    assert "zero_force_ds_cpu_optimizer" not in build()
    assert "offload_param" not in build(zero_stage=1, cpu_offload="optimizer")["zero_optimization"]
    user = {"train_batch_size": "auto", "zero_optimization": {"stage": 3, "overlap_comm": True}}
    merged = build_config(user, micro_batch=4, grad_accum=1, world_size=2, precision="fp32", zero_stage=None,
                          grad_clip=None, cpu_offload="none", has_batchnorm=False)
    assert merged["train_batch_size"] == 8 and merged["zero_optimization"] == {"stage": 3, "overlap_comm": True}
    assert user["train_batch_size"] == "auto"  # the caller's dict is left as it was


def test_deepspeed_is_imported_without_mlflow_which_stays_importable() -> None:
    # MLflow (installed here for --log mlflow) cost each DeepSpeed rank seconds of start-up.
    program = ("import sys; from nodescale.strategies.deepspeed import import_deepspeed; import_deepspeed('cpu'); "
               "assert 'mlflow' not in sys.modules, 'mlflow was imported'; import mlflow; print('ok')")
    result = subprocess.run([sys.executable, "-c", program], env=cli_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr
