"""The strategy options a plan compares, and how each maps onto ``nodescale train``'s flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Family = Literal["ddp", "fsdp", "zero"]


@dataclass(frozen=True)
class StrategyOption:
    """One way to train: a strategy with its sharding, activation checkpointing and CPU offload."""

    family: Family
    sharding: str = "none"  # fsdp: full, grad-op, hybrid; zero: the stage "1", "2", "3"; ddp: none
    checkpointing: bool = False
    offload: str = "none"  # what --cpu-offload says: none, optimizer (ZeRO-1/2) or all (FSDP, ZeRO-3)

    @property
    def stage(self) -> int:
        """The ZeRO stage (0 for the torch-native strategies)."""
        return int(self.sharding) if self.family == "zero" else 0

    @property
    def name(self) -> str:
        """How the table names it: ``fsdp grad-op +ac +offload``."""
        base = {"ddp": "ddp", "fsdp": f"fsdp {self.sharding}", "zero": f"zero-{self.sharding}"}[self.family]
        return base + (" +ac" if self.checkpointing else "") + (" +offload" if self.offload != "none" else "")

    def train_flags(self) -> list[str]:
        """The ``nodescale train`` flags that choose this option."""
        flags = {"ddp": ["--strategy", "ddp"], "fsdp": ["--strategy", "fsdp", "--sharding", self.sharding],
                 "zero": ["--strategy", "deepspeed", "--zero-stage", self.sharding]}[self.family]
        if self.offload != "none":
            flags += ["--cpu-offload", self.offload]
        return flags + (["--activation-checkpointing"] if self.checkpointing else [])


def _offload_for(family: Family, sharding: str) -> str | None:
    """The offload each option can add (None: none): FSDP moves everything, ZeRO-1/2 the optimiser only."""
    if family == "fsdp":
        return "all"
    if family == "zero":
        return "all" if sharding == "3" else "optimizer"
    return None


BASES: tuple[tuple[Family, str], ...] = (
    ("ddp", "none"), ("fsdp", "full"), ("fsdp", "grad-op"), ("fsdp", "hybrid"),
    ("zero", "1"), ("zero", "2"), ("zero", "3"),
)


def all_options(checkpointing: bool = True, offload: bool = True) -> list[StrategyOption]:
    """Every option: each base strategy with and without activation checkpointing and CPU offload."""
    found = []
    for family, sharding in BASES:
        offloads = ["none"] + ([o] if offload and (o := _offload_for(family, sharding)) else [])
        for ac in ((False, True) if checkpointing else (False,)):
            found += [StrategyOption(family, sharding, ac, off) for off in offloads]
    return found


def options_for_strategy(section: object) -> list[StrategyOption]:
    """The options ``--strategy`` asks about: ``auto`` (None) is every one; a named strategy its own family.

    ``section`` is the run's strategy section (``config.strategy``), or None for ``auto``.
    """
    options = all_options()
    if section is None:
        return options
    name = getattr(section, "name", "ddp")
    if name == "fsdp":
        return [o for o in options if o.family == "fsdp" and o.sharding == section.sharding]  # type: ignore[attr-defined]
    if name == "deepspeed":
        stage = getattr(section, "zero_stage", None)
        return [o for o in options if o.family == "zero" and (stage is None or o.stage == stage)]
    return [o for o in options if o.family == "ddp"]
