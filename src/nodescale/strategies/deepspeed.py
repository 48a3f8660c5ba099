"""DeepSpeed ZeRO (``--strategy deepspeed``): stages 0-3 through the real ``deepspeed`` engine.

nodescale keeps what it does for every strategy: its process group (DeepSpeed
reuses it, so torchrun, srun, mpiexec and ``--nproc`` all work), its data
sharding, its loss normalisation over the accumulation window, its optimiser
and learning-rate schedule. DeepSpeed's engine takes the backward and the step:
it partitions optimiser state (stage 1), gradients (2) and parameters (3), keeps
the fp32 master copy under bf16/fp16, and clips.

Checkpoints are DeepSpeed's own (every rank writes its partition) with
nodescale's trainer state beside them. ZeRO 1-3 checkpoints resume only on the
world size that wrote them (DeepSpeed cannot repartition optimiser state);
``nodescale checkpoint export`` consolidates them into one plain state dict
(:mod:`nodescale.strategies.deepspeed_export`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nodescale.config.schema import RunConfig
from nodescale.config.strategy import DeepSpeedSection
from nodescale.distributed.process_group import Runtime
from nodescale.errors import UserError
from nodescale.models.introspect import has_batchnorm
from nodescale.strategies.base import Footprint
from nodescale.strategies.deepspeed_config import config_for_run
from nodescale.strategies.footprint import StorageCounter
from nodescale.strategies.offload import refuse_offload_without_accelerator

TAG = "deepspeed"  # the one tag inside a nodescale checkpoint directory
_PARTITION = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


def import_deepspeed(device_type: str) -> Any:
    """``deepspeed``, imported quietly; a clear error where it is not installed."""
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # detection would warn on stdout that it chose the CPU
    try:
        deepspeed = _import_without_mlflow()
    except ImportError:
        raise UserError("--strategy deepspeed", "needs the deepspeed package, which is not installed",
                        "pip install deepspeed (on GPU clusters, with the CUDA toolkit matching your torch)") from None
    deepspeed.utils.logger.setLevel(logging.ERROR)
    # The shared-memory all-reduce op serves inference only; building it costs a minute on first use.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # ZeRO calls torch's older collective names; the warning is for DeepSpeed's authors, once per rank.
    old_names = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
    warnings.filterwarnings("ignore", category=FutureWarning, message=old_names)
    return deepspeed


def _import_without_mlflow() -> Any:
    """``import deepspeed`` with MLflow hidden: only DeepSpeed's autotuner, never run here, uses it,
    and importing MLflow costs every rank 2-6 s of start-up (measured on 2 cores) where it is installed."""
    if "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # makes `import mlflow` raise ImportError
    try:
        import deepspeed
    finally:
        del sys.modules["mlflow"]  # a later `import mlflow` (--log mlflow) finds the real package
    return deepspeed


class DeepSpeedUpdater:
    """The engine's backward and step; nodescale decides where accumulation windows close."""

    def __init__(self, engine: Any) -> None:
        self.model = engine

    def accumulating(self, closes_window: bool) -> AbstractContextManager[None]:
        # Forced, so a short last window of an epoch still steps.
        self.model.set_gradient_accumulation_boundary(closes_window)
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # The loss is already normalised over the window: no second division by the accumulation steps.
        self.model.backward(loss, scale_wrt_gas=False)

    def clip_grad_norm(self, max_norm: float) -> None:
        """The engine clips inside its step: set the norm it clips to (it does not say the norm)."""
        self.model._config.gradient_clipping = max_norm
        if hasattr(self.model.optimizer, "clip_grad"):
            self.model.optimizer.clip_grad = max_norm

    def step(self) -> None:
        self.model.step()

    def state_dict(self) -> dict[str, Any]:
        return {}  # the fp16 loss scale is in DeepSpeed's own checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class DeepSpeedStrategy:
    sharded_layout = "deepspeed"
    shards_state = True

    def __init__(self, cfg: DeepSpeedSection, precision: str = "fp32") -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.engine: Any = None
        self.runtime: Runtime | None = None
        self.stage = 0

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        self.runtime = runtime
        return model.to(runtime.device)

    def make_updater(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: RunConfig) -> DeepSpeedUpdater:
        assert self.runtime is not None, "wrap() first"
        refuse_offload_without_accelerator(self.cfg.cpu_offload, self.runtime.device.type != "cpu")
        deepspeed = import_deepspeed(self.runtime.device.type)
        config = config_for_run(cfg, self.runtime.world_size, has_batchnorm(model))
        self.stage = config["zero_optimization"]["stage"]
        # DeepSpeed asserts torchrun's variables even when the process group exists; srun,
        # mpiexec (MPICH, PALS) and a lone process do not set them. nodescale knows the values.
        env = self.runtime.env
        for name, value in (("LOCAL_RANK", env.local_rank), ("RANK", env.rank), ("WORLD_SIZE", env.world_size)):
            os.environ.setdefault(name, str(value))
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return DeepSpeedUpdater(self.engine)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        raise UserError("checkpoint format 'full' with strategy 'deepspeed'", "DeepSpeed writes sharded checkpoints",
                        "drop --checkpoint-format")

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        raise UserError("--resume of a full checkpoint with strategy 'deepspeed'",
                        "DeepSpeed resumes only from its own checkpoints",
                        f"resume with --strategy {state['config']['strategy']['name']}")

    def save_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag=TAG, save_latest=False)

    def load_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        assert self.runtime is not None
        saved_world = partitions(directory)
        if saved_world and saved_world != self.runtime.world_size:
            raise UserError(
                f"--resume from {directory} on {self.runtime.world_size} processes",
                f"DeepSpeed ZeRO partitions optimiser state per rank and cannot repartition it; the checkpoint was "
                f"written by {saved_world}",
                f"resume on {saved_world} processes, or `nodescale checkpoint export` the weights (FSDP and DDP "
                "resume on any world size)",
            )
        self.engine.load_checkpoint(str(directory), tag=TAG, load_lr_scheduler_states=False)

    def footprint(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Footprint:
        """What this rank holds, by kind; ZeRO keeps its partitions in the optimiser wrapper."""
        counter = StorageCounter()
        module = self.engine.module
        zero = self.engine.optimizer
        if self.stage == 3:
            parameter_bytes = counter.add(p.ds_tensor for p in module.parameters())
            parameter_bytes += counter.add(p.data for p in module.parameters())  # persistent small parameters
            gradients = list(getattr(zero, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", {}).values())
            masters = list(zero.fp32_partitioned_groups_flat)
        else:
            parameter_bytes = counter.add(p.data for p in module.parameters())
            averaged = getattr(zero, "averaged_gradients", {}) if self.stage else {}
            gradients = [t for group in averaged.values() if group for t in group]
            # ZeRO 1/2 keep the fp32 master partition; stage 0 under bf16/fp16 keeps a whole fp32
            # copy in its mixed-precision optimiser (groups of tensors).
            masters = list(getattr(zero, "single_partition_of_fp32_groups", []))
            masters += [t for group in getattr(zero, "fp32_groups", []) for t in _tensors(group)]
        gradient_bytes = counter.add(p.grad for p in module.parameters()) + counter.add(gradients)
        base = getattr(zero, "optimizer", zero)  # ZeRO wraps the torch optimiser; stage 0 is it
        optimizer_bytes = counter.add(masters) + counter.add(
            value for state in base.state.values() for value in state.values()
        )
        return Footprint(parameter_bytes, gradient_bytes, optimizer_bytes)


def _tensors(group: Any) -> list[torch.Tensor]:
    """A group entry as a list of tensors (a flat tensor, or a list of them)."""
    return [group] if isinstance(group, torch.Tensor) else [t for t in group if isinstance(t, torch.Tensor)]


def partitions(directory: Path) -> int:
    """How many ranks wrote the ZeRO optimiser partitions in ``directory`` (0: stage 0, not partitioned)."""
    tagged = directory / TAG
    return sum(1 for f in tagged.iterdir() if _PARTITION.match(f.name)) if tagged.is_dir() else 0
