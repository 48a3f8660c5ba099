"""The whole fp32 model state of a nodescale DeepSpeed checkpoint, without a process group.

DeepSpeed's ``zero_to_fp32`` unpickles every file with ``weights_only=False``, so a checkpoint
from anyone could run code on the login node that exports it. Here each file is loaded
weights-only, with the few DeepSpeed classes its optimiser files hold allow-listed
(``ZeroStageEnum``, the loss scalers, ``fragment_address``: plain values, no code on load), and
only the merging of the partitions, arithmetic on what was loaded, is DeepSpeed's. With
``trust`` (``--trust-checkpoint``) DeepSpeed's own loader reads the files.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import torch

from nodescale.errors import UserError
from nodescale.strategies.deepspeed import TAG, import_deepspeed, partitions
from nodescale.untrusted_files import load_weights


def consolidated_state(directory: Path, trust: bool = False) -> dict[str, torch.Tensor]:
    """The fp32 model state of checkpoint ``directory`` (ZeRO partitions merged); no code from its files
    runs unless ``trust``."""
    tagged = directory / TAG
    if partitions(directory):
        import_deepspeed("cpu" if not torch.cuda.is_available() else "cuda")
        with contextlib.redirect_stdout(io.StringIO()):  # its progress lines would mix with the CLI's output
            if trust:
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

                return dict(get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG))
            return _merged_partitions(tagged)
    # Stage 0 keeps the whole module in rank 0's model-states file.
    path = tagged / "mp_rank_00_model_states.pt"
    state = torch.load(path, map_location="cpu", weights_only=False) if trust else load_weights(path)
    try:
        return {name: tensor.float() if tensor.is_floating_point() else tensor
                for name, tensor in state["module"].items()}
    except (KeyError, TypeError, AttributeError) as exc:
        raise _not_readable(path, exc) from None


def _allowed() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _merged_partitions(tagged: Path) -> dict[str, torch.Tensor]:
    """zero_to_fp32's ``_get_fp32_state_dict_from_zero_checkpoint``, its files loaded weights-only."""
    from deepspeed.checkpoint import constants as names
    from deepspeed.utils import zero_to_fp32 as zero

    allowed = _allowed()
    model_files = [Path(f) for f in zero.get_model_state_files(str(tagged))]
    optim_files = [Path(f) for f in zero.get_optim_files(str(tagged))]
    model_states = [load_weights(path, allowed=allowed) for path in model_files]
    optim_states = [load_weights(path, allowed=allowed, mmap=True) for path in optim_files]
    try:
        states = [state[names.OPTIMIZER_STATE_DICT] for state in optim_states]
        for state in states:
            state.pop(names.OPTIMIZER_STATE_DICT, None)  # the optimiser's moments: not part of the model
        stage, world = states[0][names.ZERO_STAGE], states[0][names.PARTITION_COUNT]
        world = max(world) if isinstance(world, list) else world
        if world != len(states):
            raise UserError(f"checkpoint {tagged.parent}", f"holds {len(states)} ZeRO partitions of {world}",
                            "copy the checkpoint whole, or export an older one")
        groups = [state[names.SINGLE_PARTITION_OF_FP32_GROUPS if stage <= 2 else names.FP32_FLAT_GROUPS]
                  for state in states]
        parsed = [_model_state(zero, names, state) for state in model_states]
        if stage <= 2:
            paddings = states[0].get(getattr(names, "PARAM_ALIGNMENT_PADDINGS", ""))  # DeepSpeed 0.18 on
            extra = (paddings,) if paddings is not None else ()
            merged = zero._get_fp32_state_dict_from_zero2_checkpoint(world, groups, parsed, False, *extra)
        else:
            merged = zero._get_fp32_state_dict_from_zero3_checkpoint(world, groups, parsed, False)
        return dict(zero.to_torch_tensor(merged))
    except UserError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, AssertionError, RuntimeError) as exc:
        raise _not_readable(tagged.parent, exc) from None


def _model_state(zero: Any, names: Any, state: dict[str, Any]) -> Any:
    """zero_to_fp32's record of one model-states file (its ``parse_model_states``, without the load)."""
    buffer_names = state[names.BUFFER_NAMES]
    return zero.zero_model_state(
        buffers={k: v.float() if v.is_floating_point() else v for k, v in state["module"].items() if k in buffer_names},
        param_shapes=state[names.PARAM_SHAPES],
        shared_params=[[k, v] for k, v in state["shared_params"].items()],
        ds_version=state.get(names.DS_VERSION),
        frozen_param_shapes=state.get(names.FROZEN_PARAM_SHAPES),
        frozen_param_fragments=state.get(names.FROZEN_PARAM_FRAGMENTS),
    )


def _not_readable(path: Path, exc: BaseException) -> UserError:
    return UserError(f"checkpoint {path}", f"is not a DeepSpeed checkpoint nodescale can read "
                     f"({type(exc).__name__}: {exc})", "export a checkpoint written by nodescale train")
