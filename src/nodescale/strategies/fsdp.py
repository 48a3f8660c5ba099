"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimiser state sharded.

Each repeated block of the model (``models.introspect.repeated_blocks``: declared,
Hugging Face's, found, or named by ``strategy.fsdp_units``) becomes one FSDP unit,
then the root takes the rest. ``sharding`` picks how:

* ``full``: shard over every rank, free the gathered parameters after forward;
* ``grad-op``: shard, but keep parameters gathered from forward to backward
  (``reshard_after_forward=False``: one all-gather per step instead of two);
* ``hybrid``: HSDP on a 2-D mesh (replicate across nodes, shard within a node);
  on one node the replicate dimension has size 1 and it is ``full`` sharding;
* ``none``: a 2-D mesh whose shard dimension has size 1: every rank keeps every
  parameter and gradients are all-reduced (replication through FSDP2).

``tp`` > 1 (``--tp N``, with full or grad-op sharding) makes the mesh 2-D the other way,
torchtitan's: ``("dp", "tp")``, groups of N consecutive ranks along ``tp``. Each block is split
over its group first (``strategies.tensor_parallel``), then FSDP shards over ``dp``; the ranks of
a group draw the same batches (``Runtime.data_parallel_rank``).

Checkpoints are sharded by default (``TorchNative.save_sharded``: every rank
writes its own shards with ``torch.distributed.checkpoint``). ``--checkpoint-format
full`` gathers full state dicts onto rank 0 instead (``state_dict`` below), in
the same layout as the other strategies' (optimiser state keyed by parameter
index). Either resumes on any world size, or with another torch strategy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from nodescale.config.strategy import FSDPSection
from nodescale.distributed.process_group import Runtime
from nodescale.distributed.sync_batchnorm import convert_sync_batchnorm
from nodescale.errors import UserError
from nodescale.models.introspect import has_batchnorm, repeated_blocks
from nodescale.strategies.offload import refuse_offload_without_accelerator
from nodescale.strategies.tensor_parallel import apply_tensor_parallel, checked_plan
from nodescale.strategies.torch_native import TorchNative

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class FSDPStrategy(TorchNative):
    shards_state = True
    cfg: FSDPSection
    mesh: DeviceMesh | None = None  # built by wrap

    def build_mesh(self, runtime: Runtime) -> DeviceMesh:
        world = runtime.world_size
        device = runtime.device.type
        mode = self.cfg.sharding
        if self.cfg.tp > 1:
            mesh = init_device_mesh(device, (world // self.cfg.tp, self.cfg.tp), mesh_dim_names=("dp", "tp"))
            # The gradients' norm sums over both dimensions: DTensor does it in one all-reduce where the
            # flattened dimension exists (two, and a warning, otherwise), as torchtitan flattens its meshes.
            mesh._flatten("dp_tp")
            return mesh
        if mode == "hybrid":
            local = runtime.env.local_world_size
            if local < 1 or world % local:
                raise UserError(f"--sharding hybrid on {world} ranks with {local} per node",
                                "hybrid sharding needs the same number of ranks on every node",
                                "start as many processes on every node, or use --sharding full")
            return init_device_mesh(device, (world // local, local), mesh_dim_names=("replicate", "shard"))
        if mode == "none":
            return init_device_mesh(device, (world, 1), mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(device, (world,), mesh_dim_names=("shard",))

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        if self.cfg.sync_batchnorm:
            model = convert_sync_batchnorm(model, runtime.device.type)
        model = model.to(runtime.device)
        split = checked_plan(model, self.cfg.tp) if self.cfg.tp > 1 else None  # refused before any collective
        self.mesh = self.build_mesh(runtime)
        if split is not None:
            apply_tensor_parallel(model, *split, self.mesh["tp"])
        options: dict[str, Any] = {
            "mesh": self.mesh["dp"] if split is not None else self.mesh,
            "mp_policy": self.policy_for(model),
            "reshard_after_forward": self.cfg.sharding != "grad-op",
        }
        if self.cfg.cpu_offload == "all":
            options["offload_policy"] = self.offload_policy(runtime)
        for block in repeated_blocks(model, self.cfg.fsdp_units):
            fully_shard(block, **options)
        fully_shard(model, **options)
        return model

    def offload_policy(self, runtime: Runtime) -> CPUOffloadPolicy:
        """Parameters, gradients and optimiser state in pinned host memory; the optimiser steps on the CPU."""
        refuse_offload_without_accelerator(self.cfg.cpu_offload, runtime.device.type != "cpu")
        return CPUOffloadPolicy(pin_memory=True)

    def policy_for(self, model: nn.Module) -> MixedPrecisionPolicy:
        """bf16: parameters gathered in bf16, gradients reduced in fp32 (sums of many ranks lose less).

        Models with BatchNorm keep fp32 parameters: its running statistics are fp32 buffers that
        FSDP does not cast, and batch_norm refuses the mix. Their forward still runs under bf16
        autocast, as with DDP.
        """
        if self.precision == "bf16" and not has_batchnorm(model):
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        return _no_gradient_sync(model)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Full state dicts on rank 0 (empty elsewhere); a collective every rank must call."""
        model_state = get_model_state_dict(model, options=FULL)
        optim_state = get_optimizer_state_dict(model, optimizer, options=FULL)
        return {"model": model_state, "optimizer": _fqn_to_index(optim_state) if optim_state else optim_state}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load full state dicts (every rank holds the whole checkpoint) into the sharded model."""
        set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
        optim_state = _index_to_fqn(state["optimizer"], model, optimizer)
        set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))


@contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _fqn_to_index(state: dict[str, Any]) -> dict[str, Any]:
    """DCP's optimiser state (keyed by parameter name) in ``Optimizer.state_dict``'s layout (by index)."""
    index: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        ids = []
        for name in group["params"]:
            index[name] = len(index)
            ids.append(index[name])
        groups.append({**group, "params": ids})
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def _index_to_fqn(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The inverse of :func:`_fqn_to_index` for ``optimizer``'s parameters of ``model``."""
    names = {id(param): name for name, param in model.named_parameters()}
    ordered = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    saved_groups = state["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError("the saved optimiser parameter groups do not match this model's")
    by_index = dict(zip([i for g in saved_groups for i in g["params"]], ordered, strict=True))
    groups = [{**group, "params": [by_index[i] for i in group["params"]]} for group in saved_groups]
    return {"state": {by_index[int(i)]: value for i, value in state["state"].items()}, "param_groups": groups}
