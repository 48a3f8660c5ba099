"""Hardening at the edges (issue 36): input that passed the checks and then failed somewhere worse.

* Numbers: every numeric setting holds only what the code using it can take (finite, within the
  integer type it becomes, a timeout torch accepts), refused before any process starts; a
  Hypothesis search feeds each one extreme values and uses what is accepted as nodescale does.
* YAML: configurations and ``--set`` values are read with limits on size, alias expansion and depth.
* Backends: nccl on a machine without CUDA is refused before any process starts (CLI and library).
* Files: a path in the way of a save is named; job directories and logs have one mode for every
  scheduler, the local one included.

The crafted checkpoints that must not run code are in tests/test_deepspeed.py (DeepSpeed's files,
from a real run) and below (torch.distributed.checkpoint's, written here).
"""

from __future__ import annotations

import builtins
import os
import pickle
import random
import stat
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import BaseModel

import nodescale
from nodescale.config.load import load_config
from nodescale.config.schema import RunConfig
from nodescale.config.strategy import SECTIONS as STRATEGY_SECTIONS
from nodescale.data.sharding import ShardPlan, epoch_seed
from nodescale.distributed.watchdog import interval_for
from nodescale.engine import checkpoint_files, manifest
from nodescale.errors import UserError
from nodescale.train.export import consolidated_model_state
from test_hostile_input import few, run_main

# --- values the ranks could not use --------------------------------------------------------------

TRAIN = ["train", "--max-steps", "1", "--no-progress", "--nproc", "2"]


@pytest.mark.parametrize(("flag", "value", "rule"), [
    ("--seed", str(2**64), "less than or equal to 18446744073709551615"),
    ("--collective-timeout", "inf", "finite"),
    ("--heartbeat-timeout", "1e300", "less than or equal to 100000000"),
    ("--lr", "inf", "finite"),
    ("--batch-size", str(2**63), "at most 2**63-1"),
])
def test_values_the_ranks_cannot_use_are_refused_before_any_process_starts(
        flag: str, value: str, rule: str, tmp_path: Path) -> None:
    code, _, stderr = run_main([*TRAIN, flag, value, "--out", str(tmp_path / "run")])
    assert code == 2, stderr
    assert f"{flag} {value}: " in stderr and rule in stderr and "hint:" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_the_largest_seed_orders_every_epoch() -> None:
    """2**64-1 is torch's largest seed: epoch 1 wraps to 0 instead of overflowing."""
    plan = ShardPlan(10, world_size=1, rank=0, batch_size=2, seed=2**64 - 1)
    assert torch.equal(plan.order(1), ShardPlan(10, 1, 0, 2, seed=0).order(0))
    assert len({tuple(plan.order(epoch).tolist()) for epoch in range(3)}) == 3


def _numeric_keys() -> list[tuple[str, str]]:
    """(dotted key, strategy whose section has it) of every whole-number and decimal setting."""
    def numeric(annotation: Any) -> bool:
        options = get_args(annotation) or (annotation,)
        return any(option in (int, float) for option in options)

    keys = []
    for name, field in RunConfig.model_fields.items():
        if name == "strategy":
            keys += [(f"strategy.{key}", owner) for owner, section in STRATEGY_SECTIONS.items()
                     for key, inner in section.model_fields.items() if numeric(inner.annotation)]
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys += [(f"{name}.{key}", "ddp") for key, inner in field.annotation.model_fields.items()
                     if numeric(inner.annotation)]
    return sorted(set(keys))


NUMERIC_KEYS = _numeric_keys()
EXTREMES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 1e8, 1e8 + 1, 9.3e9, 1e300, 5e-324]),
    st.sampled_from(["inf", "-inf", "nan", "1e309", "Infinity", str(2**64), "1" + "0" * 22]),
)


@pytest.fixture(scope="module")
def store() -> dist.TCPStore:
    """A store server for the timeouts' clients (one: torch's connect stalls 5 s once in a hundred or so)."""
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))


def use_as_nodescale_does(cfg: RunConfig, store: dist.TCPStore, timeouts: bool) -> None:
    """Give every number of ``cfg`` to what consumes it; an exception fails the test. ``timeouts``: connect
    a store client with each timeout, as every rank and the watchdog do (torch counts in int64 nanoseconds)."""
    torch.Generator().manual_seed(epoch_seed(cfg.train.seed, 10**6))  # every epoch's order, the largest seed too
    random.Random(cfg.train.seed)
    for timeout in (cfg.strategy.timeout_s, cfg.train.heartbeat_timeout_s):
        if timeout > 0 and timeouts:
            dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=timeout))
            interval_for(timeout)
    lock = threading.Lock()  # the monitor's sleeps: an unheld lock answers at once, or refuses the timeout
    assert lock.acquire(timeout=cfg.observe.monitor_interval_s)
    cap = getattr(cfg.strategy, "bucket_cap_mb", None)
    if cap is not None:  # DDP's bucket size in bytes, as DDP computes it
        dist._compute_bucket_assignment_by_size([torch.zeros(1)], [int(cap * 1024 * 1024)])
    for section in cfg.model_dump(exclude={"model": {"args"}, "data": {"args"}}).values():
        for key, value in (section.items() if isinstance(section, dict) else []):
            if isinstance(value, float):
                assert value == value and abs(value) != float("inf"), (key, value)
            elif isinstance(value, int) and not isinstance(value, bool) and key != "seed":
                torch.tensor(value, dtype=torch.int64)  # the integer type sizes, counts and steps become


@few(150)
@given(key=st.sampled_from(NUMERIC_KEYS), value=EXTREMES)
@example(key=("train.seed", "ddp"), value=2**64)
@example(key=("train.seed", "ddp"), value=2**64 - 1)
@example(key=("strategy.timeout_s", "ddp"), value="inf")
@example(key=("train.heartbeat_timeout_s", "ddp"), value=1e300)
@example(key=("optim.lr", "ddp"), value="inf")
@example(key=("observe.monitor_interval_s", "ddp"), value=1e300)
@example(key=("strategy.bucket_cap_mb", "ddp"), value=1e300)
def test_any_number_that_passes_validation_can_be_used(key: tuple[str, str], value: Any,
                                                       store: dist.TCPStore) -> None:
    dotted, strategy = key
    try:
        cfg = load_config(None, {"strategy.name": strategy, dotted: value})
    except UserError as exc:
        assert str(exc).strip()
        return
    use_as_nodescale_does(cfg, store, timeouts=dotted.endswith("timeout_s"))


# --- YAML that costs without bound ---------------------------------------------------------------


def bomb(levels: int) -> str:
    """The issue's shape: each list holds nine aliases of the one before (9**levels values in ~40 bytes a level)."""
    lines, previous = ["a: &a [x, x, x, x, x, x, x, x, x]"], "a"
    for number in range(1, levels):
        name = f"l{number}"
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
        previous = name
    return "{" + ", ".join(lines) + "}"


@pytest.fixture
def plugin_dataset(tmp_path: Path) -> str:
    """A dataset function, so that data.args are valid keys (nothing runs: config show reads the file only)."""
    (tmp_path / "data_fn.py").write_text("def make(**kwargs):\n    raise NotImplementedError\n")
    return f"{tmp_path / 'data_fn.py'}:make"


@pytest.mark.parametrize(("document", "limit"), [
    (bomb(8), "expands to more than 100,000 values"),  # the 385 bytes: minutes and gigabytes before
    (bomb(6), "expands to more than 100,000 values"),  # 531,441 values: small enough to finish without the limit
    ("&a [1, *a]", "an alias inside the node it names"),
    ("[" * 101 + "]" * 101, "nested more than 100 levels deep"),
    ("{a: &a " + "[" * 60 + "]" * 60 + ", b: " + "[" * 50 + "*a" + "]" * 50 + "}", "100 levels deep once its aliases"),
    ("1" * 5000, "cannot be read"),
])
def test_configs_are_read_within_limits(document: str, limit: str, plugin_dataset: str, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"data:\n  name: {plugin_dataset}\n  args:\n    big: {document}\n")
    for argv in (["--config", str(config)], ["--dataset", plugin_dataset, "--set", f"data.args.big={document}"]):
        code, stdout, stderr = run_main(["config", "show", *argv])
        assert code == 2 and limit in stderr and "hint:" in stderr, (argv[0], code, stderr[-500:])
        assert "Traceback" not in stderr and not stdout


def test_a_config_file_past_the_size_limit_is_not_read_whole(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("# padding\n" * 200_000)  # 2 MB of comments: valid YAML, and nothing in it
    code, _, stderr = run_main(["config", "show", "--config", str(config)])
    assert code == 2 and "is larger than 1024 KiB" in stderr


# --- backends this machine cannot run ------------------------------------------------------------

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="nccl runs here")


@needs_no_cuda
def test_nccl_without_cuda_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    code, _, stderr = run_main([*TRAIN, "--backend", "nccl", "--out", str(tmp_path / "run")])
    assert code == 2 and "--backend nccl: NCCL needs a CUDA device" in stderr and "--backend gloo" in stderr
    assert not (tmp_path / "run").exists()


@needs_no_cuda
def test_nodescale_init_refuses_nccl_without_cuda_before_joining_a_group() -> None:
    with pytest.raises(UserError, match=r"backend nccl: NCCL needs a CUDA device(.|\n)*hint: .*init\(backend="):
        nodescale.init(strategy="ddp", backend="nccl")
    assert not dist.is_initialized()


# --- checkpoints from elsewhere ------------------------------------------------------------------


class Payload:
    """Unpickled, it creates ``marker``: proof that loading ran code from the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return builtins.open, (self.marker, "w")


def dcp_checkpoint(path: Path, model: dict[str, Any]) -> Path:
    """A sharded nodescale checkpoint in torch.distributed.checkpoint's layout, with its manifest."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    torch.save({"format": checkpoint_files.FORMAT, "layout": "torch-dcp", "world_size": 2, "batch_size": 4,
                "position": {"global_step": 4, "epoch": 0, "batch_in_epoch": 4}, "config": {}},
               path / checkpoint_files.TRAINER_FILE)
    return seal(path)


def seal(path: Path) -> Path:
    """A manifest that matches the directory's files now: a crafted checkpoint comes with one."""
    names = sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file() and f.name != "manifest.json")
    manifest.write(path / manifest.DIRECTORY_MANIFEST, manifest.describe_files(path, names))
    return path


@pytest.mark.parametrize("where", ["metadata", "byte item"])
def test_a_crafted_dcp_checkpoint_runs_no_code_on_export_or_info(where: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    model: dict[str, Any] = {"w": torch.arange(4.0)}
    if where == "byte item":
        model["extra"] = Payload(marker)  # saved as a pickled item; torch's planner loads them weights_only=False
    path = dcp_checkpoint(tmp_path / "step-00000004", model)
    assert not marker.exists()
    if where == "metadata":
        metadata = pickle.loads((path / ".metadata").read_bytes())
        metadata.planner_data = Payload(marker)
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
        seal(path)
    for argv in (["export", str(path), "--out", str(tmp_path / "w.pt")], ["info", str(path), "--json"]):
        code, _, stderr = run_main(["checkpoint", *argv])
        assert not marker.exists(), f"checkpoint {argv[0]} ran code from the checkpoint"
        if argv[0] == "info" and where == "byte item":
            assert code == 0, stderr  # info reads the metadata only
            continue
        assert code == 2 and "holds an object of io.open, which a weights-only load refuses" in stderr, stderr
        assert "--trust-checkpoint" in stderr and "Traceback" not in stderr


def test_a_genuine_dcp_checkpoint_exports_its_values_trusted_or_not(tmp_path: Path) -> None:
    path = dcp_checkpoint(tmp_path / "step-00000004", {"w": torch.arange(4.0), "note": {"steps": 4}})
    for trust in (False, True):
        state = consolidated_model_state(path, trust)
        assert torch.equal(state["w"], torch.arange(4.0)) and state["note"] == {"steps": 4}
    path = dcp_checkpoint(tmp_path / "step-00000008", {"w": torch.arange(4.0)})
    code, _, stderr = run_main(["checkpoint", "export", str(path), "--out", str(tmp_path / "w.pt")])
    assert code == 0 and torch.equal(torch.load(tmp_path / "w.pt", weights_only=True)["w"], torch.arange(4.0))


def test_a_directory_where_the_checkpoint_file_goes_is_named(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "step-00000004.pt").mkdir(parents=True)
    with pytest.raises(UserError, match=r"step-00000004.pt: is a directory, where nodescale writes a file"):
        checkpoint_files.save(tmp_path, 4, {"model": {}}, keep_last=2)


def test_a_file_where_a_checkpoint_directory_goes_is_named(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-00000004").write_text("not a checkpoint")
    with pytest.raises(UserError, match=r"step-00000004: is a file, where nodescale writes a checkpoint directory"):
        checkpoint_files.begin_sharded(tmp_path, 4)
    (tmp_path / "elsewhere").write_text("")
    with pytest.raises(UserError, match=r"elsewhere: is a file, where nodescale writes a directory"):
        checkpoint_files.save(tmp_path / "elsewhere" / "run", 4, {"model": {}}, keep_last=2)


# --- permissions: one rule for every scheduler ---------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Any:
    """The common umask 022, under which a plain mkdir or open gives 0755 and 0644."""
    before = os.umask(0o022)
    yield
    os.umask(before)


def test_a_local_job_directory_and_its_log_have_the_batch_schedulers_modes(tmp_path: Path, open_umask: None) -> None:
    from nodescale.launch.schedulers.local_launcher import launch_local

    assert launch_local(["true"], 2, log_dir=tmp_path / "jobs") == 0
    assert (mode(tmp_path / "jobs"), mode(tmp_path / "jobs" / "ranks.log")) == (0o750, 0o640)
    (tmp_path / "jobs" / "ranks.log").chmod(0o666)  # an older launch's log loses what the rule does not give
    assert launch_local(["true"], 2, log_dir=tmp_path / "jobs") == 0
    assert mode(tmp_path / "jobs" / "ranks.log") == 0o640


def test_a_slurm_job_directory_and_its_script_have_the_same_modes(
        tmp_path: Path, open_umask: None, monkeypatch: pytest.MonkeyPatch) -> None:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in {"sbatch": "echo 4242", "sinfo": "true", "scontrol": "true", "squeue": "true"}.items():
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{stubs}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the job registry
    code, stdout, stderr = run_main(["launch", "--scheduler", "slurm", "--job-dir", str(tmp_path / "jobs"), "--",
                                     "true"])
    assert code == 0 and "submitted slurm job 4242" in stdout, stderr
    (script,) = (tmp_path / "jobs").glob("*.sh")
    assert (mode(tmp_path / "jobs"), mode(script)) == (0o750, 0o750)
