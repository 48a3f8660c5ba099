"""Parallel strategies by name."""

from __future__ import annotations

from nodescale.config.schema import STRATEGIES, StrategySection
from nodescale.errors import unknown_choice
from nodescale.strategies.base import Strategy


def make_strategy(cfg: StrategySection, precision: str = "fp32") -> Strategy:
    """The strategy object for ``cfg.name`` (``precision``: the run's, for FSDP's mixed-precision policy)."""
    if cfg.name == "single":
        from nodescale.strategies.single import SingleDevice
        return SingleDevice()
    if cfg.name == "dp":
        from nodescale.strategies.dp import DataParallelStrategy
        return DataParallelStrategy()
    if cfg.name == "ddp":
        from nodescale.strategies.ddp import DDPStrategy
        return DDPStrategy(cfg)
    if cfg.name == "fsdp":
        from nodescale.strategies.fsdp import FSDPStrategy
        return FSDPStrategy(cfg, precision)
    if cfg.name == "deepspeed":
        from nodescale.strategies.deepspeed import DeepSpeedStrategy  # imports deepspeed only when chosen
        return DeepSpeedStrategy(cfg)
    raise unknown_choice("strategy", cfg.name, STRATEGIES)
