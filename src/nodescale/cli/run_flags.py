"""The flags of ``nodescale train`` (and ``config show``), mapped to configuration keys.

Help texts come from the configuration schema's field descriptions, so the
two never disagree. Values are passed on as strings and converted by the
schema, so every bad value gets the same kind of error.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from nodescale.config.load import field_description, parse_assignment
from nodescale.config.schema import RunConfig
from nodescale.config.strategy import another_strategys_key


@dataclass(frozen=True)
class Flag:
    name: str
    key: str
    switch: Any = None  # value set by a flag that takes no argument
    help: str | None = None  # when the schema's description would read wrong for this flag


FLAGS = (
    Flag("--model", "model.name"),
    Flag("--dataset", "data.name"),
    Flag("--loss", "train.loss"),
    Flag("--data-dir", "data.dir"),
    Flag("--seq-len", "data.seq_len"),
    Flag("--stage", "data.stage"),
    Flag("--strategy", "strategy.name"),
    Flag("--nproc", "strategy.nproc"),
    Flag("--backend", "strategy.backend"),
    Flag("--sharding", "strategy.sharding"),
    Flag("--zero-stage", "strategy.zero_stage"),
    Flag("--deepspeed-config", "strategy.deepspeed_config"),
    Flag("--cpu-offload", "strategy.cpu_offload"),
    Flag("--tp", "strategy.tp"),
    Flag("--epochs", "train.epochs"),
    Flag("--max-steps", "train.max_steps"),
    Flag("--batch-size", "train.batch_size"),
    Flag("--grad-accum", "train.grad_accum"),
    Flag("--lr", "optim.lr"),
    Flag("--optimizer", "optim.name"),
    Flag("--seed", "train.seed"),
    Flag("--precision", "train.precision"),
    Flag("--log-every", "train.log_every"),
    Flag("--stop-signals", "train.stop_signals"),
    Flag("--heartbeat-timeout", "train.heartbeat_timeout_s"),
    Flag("--collective-timeout", "strategy.timeout_s"),
    Flag("--checkpoint-every", "checkpoint.every"),
    Flag("--keep-last", "checkpoint.keep_last"),
    Flag("--checkpoint-format", "checkpoint.format"),
    Flag("--checkpoint-stage", "checkpoint.stage"),
    Flag("--max-restarts", "checkpoint.max_restarts"),
    Flag("--out", "out"),
    Flag("--log", "observe.log"),
    Flag("--mlflow-uri", "observe.mlflow_uri"),
    Flag("--experiment", "observe.experiment"),
    Flag("--wandb-mode", "observe.wandb_mode"),
    Flag("--monitor-interval", "observe.monitor_interval_s"),
    Flag("--profile", "observe.profile"),
    Flag("--sync-batchnorm", "strategy.sync_batchnorm", switch=True),
    Flag("--compile", "train.compile", switch=True),
    Flag("--channels-last", "train.channels_last", switch=True),
    Flag("--tf32", "train.tf32", switch=True,
         help="TF32 tensor cores for float32 matmuls and convolutions on CUDA (--set train.tf32=false: strict fp32)"),
    Flag("--activation-checkpointing", "train.activation_checkpointing", switch=True),
    Flag("--resume", "checkpoint.resume", switch=True),
    Flag("--checkpoint-async", "checkpoint.async_save", switch=True),
    Flag("--monitor", "observe.monitor", switch=True),
    Flag("--skip-bad-samples", "data.skip_bad_samples", switch=True),
    Flag("--decode", "data.decode"),
    Flag("--augment", "data.augment", switch=True),
    Flag("--no-progress", "train.progress", switch=False,
         help="no progress bar: plain lines per log interval and per epoch"),
)

FLAG_NAMES = {flag.key: flag.name for flag in FLAGS}


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--config``, every run flag and ``--set`` to ``parser``."""
    parser.add_argument("--config", metavar="FILE", help="YAML configuration (flags override it)")
    for flag in FLAGS:
        dest = flag.key.replace(".", "__")
        if flag.switch is None:
            parser.add_argument(flag.name, dest=dest, metavar=flag.name.strip("-").split("-")[-1].upper(),
                                help=flag.help or field_description(flag.key))
        else:
            parser.add_argument(flag.name, dest=dest, action="store_const", const=flag.switch,
                                help=flag.help or field_description(flag.key))
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                        help="set any configuration key, e.g. --set optim.weight_decay=0.05 (repeatable)")


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted-key overrides from the flags the user actually gave (``--set`` first, flags win)."""
    overrides = dict(parse_assignment(text) for text in args.assignments)
    overrides.update(_flag_values(args))
    return overrides


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    values = {flag.key: getattr(args, flag.key.replace(".", "__")) for flag in FLAGS}
    return {key: value for key, value in values.items() if value is not None}


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """The validated configuration: defaults < ``--config`` file < ``--set`` < flags."""
    from nodescale.config.load import load_config, with_absolute_inputs

    # Errors name the flag only for values that came from a flag, not from --set or YAML.
    typed = {key: FLAG_NAMES[key] for key in _flag_values(args)}
    overrides = overrides_from(args)
    cfg = load_config(args.config, overrides, typed)
    for key in typed:  # a strategy flag typed for a strategy without it, even at its default (--sharding full)
        section, _, name = key.partition(".")
        if section == "strategy" and name not in type(cfg.strategy).model_fields:
            raise another_strategys_key(cfg.strategy.name, name, overrides[key], typed[key])
    return with_absolute_inputs(cfg)
