"""Shared test helpers: run the real CLI in subprocesses and read what runs wrote."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import cli_zygote

REPO = Path(__file__).resolve().parents[1]

# The scheduler fixtures (one Slurm cluster per xdist worker, pbs_run) are registered once here; test
# modules that imported them each started a cluster of their own. worker_groups keeps the files that
# share a session run or the cluster on one worker.
pytest_plugins = ["scheduler_fixtures", "worker_groups"]


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    # No inherited launcher variables: each test decides how processes start.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(name, None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def free_port() -> int:
    """A TCP port free now on 127.0.0.1: for runs that would otherwise all take the default 29500 at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_cli(args: list[str], cwd: Path, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``nodescale ARGS`` in a process of its own; fails the test with its output if ``check`` and it failed.

    The process is forked from one that imported torch already (``cli_zygote``), unless
    ``NODESCALE_TEST_FRESH_CLI=1`` asks for a fresh interpreter each time.
    """
    if cli_zygote.fresh_processes():
        result = subprocess.run([sys.executable, "-m", "nodescale", *args], cwd=cwd, env=cli_env(),
                                capture_output=True, text=True, timeout=timeout)
    else:
        result = cli_zygote.run(args, cwd, cli_env(), timeout)
    if check and result.returncode != 0:
        pytest.fail(f"nodescale {' '.join(args)} exited {result.returncode}\n"
                    f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}")
    return result


# How torchrun's agent and nodescale's launcher both name a worker killed by these signals.
_WORKER_CRASH = re.compile(r"\(SIG(ABRT|SEGV)\)")


def once_more_if_torch_crashed(
        attempt: Callable[[int], subprocess.CompletedProcess[str]]) -> subprocess.CompletedProcess[str]:
    """``attempt(1)``; and ``attempt(2)`` (which writes elsewhere) if a worker of the first was killed by
    SIGABRT or SIGSEGV. For the 2-rank gloo DDP runs under torch's profiler only.

    Why: one CI run saw rank 0 abort with glibc's "malloc(): unsorted double linked list corrupted"
    right after torch 2.13's profiler stopped under DDP on gloo, a crash inside torch's C++ code that
    several hundred runs here (with and without CPU contention, and with a widened gap between a gloo
    work's completion and its profiler callback) never reproduced. A second crash, or any other
    failure, still fails the test.
    """
    run = attempt(1)
    if run.returncode == 0 or _WORKER_CRASH.search(run.stderr) is None:
        return run
    warnings.warn(f"a worker crashed inside torch; running once more:\n{run.stderr[-2000:]}", stacklevel=2)
    return attempt(2)


def observed_model(model: str, shape: tuple[int, ...], record: Path, watch: list[str], **settings: Any) -> list[str]:
    """``--model`` flags for nodescale's ``model`` (for samples of ``shape``, 10 classes) built through
    tests/user_code/observed.py, which records each forward of the ``watch`` modules in ``record``."""
    flags = ["--model", f"{REPO / 'tests' / 'user_code' / 'observed.py'}:build"]
    values = {"model": model, "shape": list(shape), "record": str(record), "watch": watch, **settings}
    for key, value in values.items():
        flags += ["--set", f"model.args.{key}={json.dumps(value)}"]
    return flags


def observed_forwards(record: Path) -> dict[int, list[dict[str, Any]]]:
    """rank -> the forwards of its watched modules, in order: module, training (with gradients), and the
    dtypes of input, weight and output (tests/user_code/observed.py)."""
    return {int(path.stem.removeprefix("rank-")): [json.loads(line) for line in path.read_text().splitlines()]
            for path in sorted(record.glob("rank-*.jsonl"))}


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model state of the newest checkpoint of a run (a full file or a sharded directory)."""
    from nodescale.train.export import consolidated_model_state, resolve

    return consolidated_model_state(resolve(run_dir))


def weights_as_saved(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model state in the files of ``checkpoint`` (a full file, a DCP or a DeepSpeed directory), read by
    the libraries' own loaders, not nodescale's (``final_weights``): what an export must equal."""
    if checkpoint.is_file():
        return dict(torch.load(checkpoint, map_location="cpu", weights_only=True)["model"])
    if (checkpoint / ".metadata").is_file():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        reader = dcp.FileSystemReader(checkpoint)
        entries = reader.read_metadata().state_dict_metadata
        # Whole tensors of the saved sizes: DCP reads every shard's piece into them (no process group).
        state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in entries.items()
                 if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
        with warnings.catch_warnings():  # that it assumes one process: it is right
            warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
            dcp.load(state, storage_reader=reader, no_dist=True)
        return {key.removeprefix("model."): tensor for key, tensor in state.items()}
    from nodescale.strategies.deepspeed import TAG, import_deepspeed

    import_deepspeed("cpu")  # the accelerator it runs on; the files are read by DeepSpeed alone
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=TAG))


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())
