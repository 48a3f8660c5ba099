"""The strategy section: one class per strategy, chosen by ``name`` (a discriminated union).

Each class holds only the keys that mean something for its strategy, so ``sharding``
with ddp cannot be written, and says the facts the rest of nodescale reads:
whether it runs one process per device in a process group (``multi_process``) and
which class implements it. Torch-free, like the rest of the schema.

Configurations written before the union (every strategy's key at its value, defaults
included, in every run's config.yaml) still load: a key of another strategy that
holds its default is dropped, one set to something else is refused with the rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError, field_validator, model_validator

from nodescale.errors import UserError, unknown_choice
from nodescale.section import MAX_SECONDS, Section

_SYNC_BATCHNORM = "synchronise BatchNorm statistics across ranks"


def _name(name: str) -> Any:
    return Field(name, description="parallel strategy: single, dp, ddp, fsdp or deepspeed")


class _Strategy(Section):
    """The keys of every strategy."""

    multi_process: ClassVar[bool] = True  # one process per device, joined in a process group
    implementation: ClassVar[str]  # module:class of nodescale.strategies that runs it

    name: str  # each strategy's own literal (the union's discriminator); declared here to come first
    nproc: int | Literal["auto"] = Field(
        "auto", description="local processes to start; auto: one per GPU, or 2 on a CPU-only machine"
    )
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="collective backend; auto: nccl on CUDA")
    # At least a second: torch's store must connect within it before the first collective.
    timeout_s: float = Field(600.0, ge=1, le=MAX_SECONDS, description="collective timeout in seconds")
    fsdp_units: list[str] = Field(
        default_factory=list, description="class names of the modules that become FSDP units and activation "
        "checkpointing blocks (comma-separated); default: the model's own (see docs/training.md)"
    )

    @field_validator("fsdp_units", mode="before")
    @classmethod
    def _class_names(cls, value: object) -> list[str]:
        parts = [p for p in value.split(",") if p.strip()] if isinstance(value, str) else value
        if not isinstance(parts, (list, tuple)) or not all(str(p).strip().isidentifier() for p in parts):
            raise UserError(f"strategy.fsdp_units {value!r}", "must be class names, comma-separated",
                            "e.g. --set strategy.fsdp_units=TransformerBlock,Embeddings")
        return [str(part).strip() for part in parts]

    @field_validator("nproc", mode="before")
    @classmethod
    def _positive_nproc(cls, value: object) -> int | str:
        # One message for every bad form, instead of pydantic's per-union-member errors.
        if value == "auto":
            return "auto"
        text = str(value).strip()
        if isinstance(value, bool) or not text.lstrip("-").isdigit() or int(text) < 1:
            raise UserError(f"nproc {value!r}", "must be a whole number of processes, at least 1, or 'auto'",
                            "use --nproc 2, or leave it out for one per GPU (2 on CPU)")
        return int(text)


class _OneProcess(_Strategy):
    multi_process: ClassVar[bool] = False

    @model_validator(mode="after")
    def _one_process(self) -> _OneProcess:
        name = self.name  # type: ignore[attr-defined]
        if isinstance(self.nproc, int) and self.nproc > 1:
            raise UserError(f"strategy {name!r} with nproc {self.nproc}", f"{name} runs in one process",
                            "use --strategy ddp for several processes")
        return self


class SingleSection(_OneProcess):
    implementation: ClassVar[str] = "single:SingleDevice"
    name: Literal["single"] = _name("single")


class DPSection(_OneProcess):
    implementation: ClassVar[str] = "dp:DataParallelStrategy"
    name: Literal["dp"] = _name("dp")


class DDPSection(_Strategy):
    implementation: ClassVar[str] = "ddp:DDPStrategy"
    name: Literal["ddp"] = _name("ddp")
    sync_batchnorm: bool = Field(False, title="--sync-batchnorm", description=_SYNC_BATCHNORM)
    bucket_cap_mb: float | None = Field(
        None, gt=0, le=2**20, description="DDP gradient bucket size in MB; default: DDP's own (a small first "
        "bucket, then 25)"
    )
    static_graph: bool = Field(False, description="DDP static_graph (the same parameters used every step)")
    gradient_as_bucket_view: bool = Field(True, description="DDP gradients as views into buckets (saves memory)")
    find_unused_parameters: bool = Field(False, description="DDP: allow parameters without gradients")


class FSDPSection(_Strategy):
    implementation: ClassVar[str] = "fsdp:FSDPStrategy"
    name: Literal["fsdp"] = _name("fsdp")
    sync_batchnorm: bool = Field(False, title="--sync-batchnorm", description=_SYNC_BATCHNORM)
    sharding: Literal["full", "grad-op", "hybrid", "none"] = Field(
        "full", title="--sharding", description="FSDP sharding: full (reshard after forward), grad-op (keep "
        "parameters gathered until backward), hybrid (shard within a node, replicate across nodes), none (replicate)"
    )
    cpu_offload: Literal["none", "optimizer", "all"] = Field(
        "none", title="--cpu-offload", description="keep state in host memory: optimizer (DeepSpeed: optimiser "
        "state) or all (FSDP: parameters, gradients and optimiser; DeepSpeed ZeRO-3: optimiser and parameters); "
        "needs a GPU"
    )
    tp: int = Field(
        1, ge=1, title="--tp", description="tensor parallelism: split each block's attention and MLP over groups of "
        "this many consecutive ranks, FSDP across the groups (a 2-D mesh, dp x tp); the model must declare a plan"
    )

    @field_validator("cpu_offload")
    @classmethod
    def _all_or_nothing(cls, value: str) -> str:
        if value == "optimizer":
            raise UserError("cpu_offload 'optimizer' with strategy 'fsdp'",
                            "FSDP offloads parameters, gradients and optimiser state together",
                            "use --cpu-offload all, or --strategy deepspeed for optimiser-only offload")
        return value

    @model_validator(mode="after")
    def _one_second_dimension(self) -> FSDPSection:
        if self.tp > 1 and self.sharding in ("hybrid", "none"):
            raise UserError(f"--tp {self.tp} with --sharding {self.sharding}",
                            f"--sharding {self.sharding} already makes a 2-D mesh (replicate x shard); --tp takes the "
                            "second dimension for tensor parallelism", "use --sharding full or grad-op with --tp")
        return self


def check_tensor_parallel_world(strategy: Any, world_size: int) -> None:
    """``strategy.tp`` (fsdp's; 1 elsewhere) must divide the ranks into whole tensor-parallel groups."""
    tp = getattr(strategy, "tp", 1)
    if world_size % tp:
        fits = -(-world_size // tp) * tp  # the next multiple
        raise UserError(f"--tp {tp} on {world_size} ranks", f"the world size must be a multiple of --tp ({tp})",
                        f"start {fits} processes (e.g. --nproc {fits}), or use a --tp that divides {world_size}")


class DeepSpeedSection(_Strategy):
    implementation: ClassVar[str] = "deepspeed:DeepSpeedStrategy"
    name: Literal["deepspeed"] = _name("deepspeed")
    zero_stage: int | None = Field(
        None, ge=0, le=3, title="--zero-stage",
        description="DeepSpeed ZeRO stage 0-3; default: the --deepspeed-config file's, else 2"
    )
    deepspeed_config: Path | None = Field(
        None, title="--deepspeed-config",
        description="DeepSpeed JSON config (ds_config.json); nodescale fills in what it leaves out"
    )
    cpu_offload: Literal["none", "optimizer", "all"] = FSDPSection.model_fields["cpu_offload"]


SECTIONS: dict[str, type[_Strategy]] = {
    cls.model_fields["name"].default: cls for cls in (SingleSection, DPSection, DDPSection, FSDPSection,
                                                      DeepSpeedSection)
}
STRATEGIES = tuple(SECTIONS)


def _chosen_strategy(value: Any) -> Any:
    """The section's keys for its strategy: another strategy's key at its default dropped, else refused."""
    if not isinstance(value, dict):
        return value  # a section already built, or not a mapping (pydantic says so)
    name = value.get("name", "ddp")
    if not isinstance(name, str) or name not in SECTIONS:
        raise unknown_choice("strategy", str(name), STRATEGIES)
    own = SECTIONS[name].model_fields
    kept = {"name": name}
    for key, item in value.items():
        owners = _owners(key)
        if key in own or not owners:  # not a strategy key at all: extra="forbid" names it
            kept[key] = item
        elif not any(_is_default(SECTIONS[owner], key, item) for owner in owners):
            raise another_strategys_key(name, key, item)
    return kept


def _owners(key: str) -> list[str]:
    """The strategies whose sections have ``key``."""
    return [name for name, cls in SECTIONS.items() if key in cls.model_fields]


def _is_default(cls: type[_Strategy], key: str, value: Any) -> bool:
    try:
        return getattr(cls.model_validate({key: value}), key) == cls.model_fields[key].get_default()
    except (ValidationError, UserError):
        return False


def another_strategys_key(name: str, key: str, value: Any, flag: str | None = None) -> UserError:
    """The error for ``key`` set to ``value`` (by ``flag``, if typed) with strategy ``name``, which lacks it."""
    owners = _owners(key)
    spoken = SECTIONS[owners[0]].model_fields[key].title or f"strategy.{key}"
    return UserError(f"{flag} {value} with strategy {name!r}" if flag else f"{key} {value!r} with strategy {name!r}",
                     f"{spoken} applies to --strategy {' or '.join(owners)}",
                     f"use --strategy {' or '.join(owners)}, or drop {spoken}")


StrategySection = Annotated[
    Union[SingleSection, DPSection, DDPSection, FSDPSection, DeepSpeedSection],  # noqa: UP007 (pydantic's union)
    Field(discriminator="name"),
    BeforeValidator(_chosen_strategy),
]
_SECTION = TypeAdapter(StrategySection)


def strategy_section(keys: dict[str, Any]) -> StrategySection:
    """The validated section of the strategy ``keys["name"]`` from its keys: another strategy's key is
    dropped at its default (``sync_batchnorm=False`` with single, an old flat layout), else refused."""
    return _SECTION.validate_python(keys)


def is_strategy_key(key: str) -> bool:
    """Whether ``key`` belongs to some strategy's section."""
    return bool(_owners(key))


def error_key(loc: tuple[Any, ...]) -> tuple[str, str | None]:
    """The dotted key of a pydantic error's location, without the union's tag; and that tag (a strategy)."""
    parts = [str(part) for part in loc]
    tag = parts.pop(1) if parts[:1] == ["strategy"] and len(parts) > 2 and parts[1] in SECTIONS else None
    return ".".join(parts), tag
