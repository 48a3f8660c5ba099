"""Combinations of settings that cannot run, rejected with the fix (``RunConfig`` calls this).

Torch-free, like the schema: it runs in the launcher before any process starts.
Models, datasets and losses given as the user's code (``FILE.py:FN``) are not
known here; what depends on them is checked by the workers once built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nodescale.data.registry import DATASETS
from nodescale.errors import UserError
from nodescale.models.registry import MODELS, model_entry
from nodescale.plugins.refs import is_plugin

if TYPE_CHECKING:
    from nodescale.config.schema import RunConfig


def check_combinations(cfg: RunConfig) -> None:
    """Reject combinations across sections that cannot run, each with the fix.

    What one strategy's keys allow is its section class's to say (``config.strategy``).
    """
    strategy = cfg.strategy
    if strategy.name == "deepspeed" and cfg.checkpoint.format == "full":
        raise UserError(
            "checkpoint format 'full' with strategy 'deepspeed'",
            "DeepSpeed writes its own sharded checkpoints",
            "drop --checkpoint-format (nodescale checkpoint export makes one file of the weights)",
        )
    if strategy.name == "deepspeed" and cfg.checkpoint.async_save:
        raise UserError("--checkpoint-async with strategy 'deepspeed'", "DeepSpeed writes its checkpoints itself",
                        "drop --checkpoint-async, or use --strategy fsdp (its shards are written in the background)")
    if strategy.name == "deepspeed" and cfg.train.compile:
        raise UserError("compile with strategy 'deepspeed'", "not supported by nodescale's DeepSpeed strategy",
                        "drop --compile, or use --strategy fsdp or ddp")
    if cfg.train.precision == "fp16" and strategy.name == "fsdp":
        raise UserError(
            "precision 'fp16' with strategy 'fsdp'",
            "not supported yet (fp16 needs a gradient scaler for sharded gradients)",
            "use --precision bf16 (no scaler needed), or --strategy ddp",
        )
    _check_what_is_trained(cfg)
    if cfg.checkpoint.resume and cfg.out is None:
        raise UserError(
            "--resume without --out",
            "resuming needs the run directory that holds the checkpoints",
            "pass --out DIR of the run to continue",
        )
    if cfg.train.precision == "fp16" and cfg.strategy.name == "dp":
        # GradScaler with DataParallel replicas is a known source of silent inf/NaN skips.
        raise UserError(
            "precision 'fp16' with strategy 'dp'", "not supported", "use --precision bf16, or --strategy ddp"
        )


def check_tensor_parallel_model(cfg: RunConfig) -> None:
    """A built-in model under ``--tp`` must declare how its blocks split (``nodescale train``, before any
    process starts: a library run's configuration names no model; the user's models are checked once built)."""
    tp, model = getattr(cfg.strategy, "tp", 1), cfg.model.name
    if tp > 1 and not is_plugin(model) and not model_entry(model).tensor_parallel:
        raise UserError(f"--tp {tp} with model {model!r}", "the model declares no tensor-parallel plan",
                        f"use one of {', '.join(n for n, e in MODELS.items() if e.tensor_parallel)}, or drop --tp")


def _check_what_is_trained(cfg: RunConfig) -> None:
    """Model, dataset, loss and their arguments; built-in ones only, except for the arguments."""
    model, data = cfg.model.name, cfg.data.name
    for section, name, flag in ((cfg.model, model, "--model"), (cfg.data, data, "--dataset")):
        key = "model.args" if flag == "--model" else "data.args"
        if section.args and not is_plugin(name):
            raise UserError(f"{key} with {flag} {name!r}", f"{key} are the keyword arguments of your own function",
                            f"give {flag} FILE.py:FUNCTION, or drop the {key}.* settings")
    if cfg.strategy.fsdp_units and cfg.strategy.name != "fsdp" and not cfg.train.activation_checkpointing:
        raise UserError(f"strategy.fsdp_units {','.join(cfg.strategy.fsdp_units)}",
                        "names the units of --strategy fsdp and of --activation-checkpointing",
                        "use one of them, or drop strategy.fsdp_units")
    if cfg.train.activation_checkpointing and not is_plugin(model) and not model_entry(model).has_blocks \
            and not cfg.strategy.fsdp_units:
        raise UserError(
            f"--activation-checkpointing with model {model!r}",
            "the model declares no repeated blocks to recompute",
            "use cnn, a ResNet or a ViT, or drop --activation-checkpointing",
        )
    data_task = None if is_plugin(data) else DATASETS[data].task
    loss_task = {"cross_entropy": "classification", "mse": "regression"}.get(cfg.train.loss)
    cross_entropy_task = loss_task == "classification" and data_task == "language_modeling"  # over each next token
    if loss_task and data_task not in (None, "any", loss_task) and not cross_entropy_task:
        raise UserError(f"--loss {cfg.train.loss} with dataset {data!r}",
                        f"{cfg.train.loss} is a {loss_task} loss but the dataset is for {data_task}",
                        "use --loss auto (the dataset's task picks it)")
    if is_plugin(model) or is_plugin(data):
        return  # their tasks are known once built: the workers check them
    model_task = model_entry(model).task
    if model_task != "any" and data_task != "any" and model_task != data_task:
        compatible = sorted(n for n, d in DATASETS.items() if d.task in (model_task, "any"))
        raise UserError(
            f"model {model!r} with dataset {data!r}",
            f"the model does {model_task} but the dataset is for {data_task}",
            f"use one of these datasets: {', '.join(compatible)}" if compatible else
            "give your own: --dataset FILE.py:FN",
        )
    if DATASETS[data].needs_dir and cfg.data.dir is None:
        raise UserError(
            f"dataset {data!r}",
            "needs the location of its files",
            f"pass --data-dir PATH ({DATASETS[data].layout})",
        )
