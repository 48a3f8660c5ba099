"""Parallel strategies by name."""

from __future__ import annotations

from importlib import import_module

from nodescale.config.strategy import StrategySection
from nodescale.strategies.base import Strategy


def make_strategy(cfg: StrategySection, precision: str = "fp32") -> Strategy:
    """The strategy object for the section ``cfg`` (``precision``: the run's, for FSDP's mixed-precision policy).

    Its module is imported only when chosen (deepspeed takes seconds).
    """
    module, _, name = type(cfg).implementation.partition(":")
    return getattr(import_module(f"nodescale.strategies.{module}"), name)(cfg, precision)
