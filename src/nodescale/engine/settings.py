"""``nodescale.init``'s keyword arguments as the one typed ``RunConfig`` that ``nodescale train`` uses.

The same validation, the same strategy objects and the same checkpoint settings serve both
faces; the model and data sections keep their defaults (a script brings its own).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from nodescale.config.schema import RunConfig
from nodescale.config.strategy import check_tensor_parallel_world, error_key
from nodescale.errors import UserError

# init()'s name -> (section, key) of RunConfig.
_KEYS = {
    "strategy": ("strategy", "name"), "backend": ("strategy", "backend"), "timeout_s": ("strategy", "timeout_s"),
    "sync_batchnorm": ("strategy", "sync_batchnorm"), "sharding": ("strategy", "sharding"),
    "zero_stage": ("strategy", "zero_stage"), "deepspeed_config": ("strategy", "deepspeed_config"),
    "cpu_offload": ("strategy", "cpu_offload"), "bucket_cap_mb": ("strategy", "bucket_cap_mb"),
    "static_graph": ("strategy", "static_graph"), "find_unused_parameters": ("strategy", "find_unused_parameters"),
    "gradient_as_bucket_view": ("strategy", "gradient_as_bucket_view"), "tp": ("strategy", "tp"),
    "precision": ("train", "precision"), "seed": ("train", "seed"), "grad_accum": ("train", "grad_accum"),
    "compile": ("train", "compile"), "stop_signals": ("train", "stop_signals"),
    "heartbeat_timeout_s": ("train", "heartbeat_timeout_s"), "timing_warmup_steps": ("train", "timing_warmup_steps"),
    "grad_clip": ("optim", "grad_clip"),
    "checkpoint_format": ("checkpoint", "format"), "keep_last": ("checkpoint", "keep_last"),
    "checkpoint_async": ("checkpoint", "async_save"), "checkpoint_stage": ("checkpoint", "stage"),
    "log": ("observe", "log"),
}
OPTIONS = tuple(_KEYS)


def run_config(world_size: int, out: str | Path | None, options: dict[str, Any]) -> RunConfig:
    """The validated configuration of a library run; ``strategy="auto"``: ddp with several processes."""
    unknown = [name for name in options if name not in _KEYS]
    if unknown:
        from nodescale.errors import did_you_mean

        guess = did_you_mean(unknown[0], _KEYS)
        raise UserError(f"nodescale.init({unknown[0]}=...)", "is not an option of init",
                        f"did you mean {guess!r}?" if guess else f"options: {', '.join(sorted(_KEYS))}")
    values = {name: value for name, value in options.items() if value is not None}
    if values.get("strategy", "auto") == "auto":
        values["strategy"] = "ddp" if world_size > 1 else "single"
    tree: dict[str, Any] = {}
    for name, value in values.items():
        section, key = _KEYS[name]
        tree.setdefault(section, {})[key] = value
    if isinstance(out, str) and not out.strip():  # Path("") is ".": the current directory, unasked
        raise UserError(f"nodescale.init(out={out!r})", "names no directory", 'give one, e.g. out="runs/mine"')
    if out is not None:
        tree["out"] = Path(out).absolute()
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        first = exc.errors()[0]
        where, _ = error_key(first["loc"])
        inner = first.get("ctx", {}).get("error")
        if isinstance(inner, UserError):
            raise inner from None
        name = next((n for n, key in _KEYS.items() if ".".join(key) == where), where)
        raise UserError(f"nodescale.init({name}={first.get('input')!r})", first["msg"].removeprefix("Value error, "),
                        "see docs/library.md for the options and their values") from None


def check_process_count(strategy: Any, env: Any, call: str, hint: str) -> None:
    """A single-process strategy (its section: single, dp) refused where a launcher started several processes,
    and a world size that ``--tp`` does not divide into whole tensor-parallel groups."""
    if env.world_size > 1 and not strategy.multi_process:
        raise UserError(f"{call} under {env.source} with {env.world_size} processes",
                        f"{strategy.name} runs in a single process", f"use {hint}, or start one process")
    check_tensor_parallel_world(strategy, env.world_size)
