"""What a job asks of the scheduler and of its software, beyond nodes and time: the typed values of
``launch``'s ``--mem``, ``--constraint``, ... and ``--module``, ``--container``, ... flags.

Each value is checked here, once, against the form Slurm documents for it (sbatch(1)); what PBS
Pro can express of it is :mod:`nodescale.launch.option_directives`'. Pure: no I/O, no scheduler.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

# sbatch(1) --mail-type, in the man page's order.
MAIL_TYPES = ("NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT", "TIME_LIMIT",
              "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS")
# sbatch(1) --dependency types that take job ids ("singleton" takes none).
DEPENDENCY_TYPES = ("after", "afterany", "afterok", "afternotok", "aftercorr", "afterburstbuffer")

_MEM = re.compile(r"^(\d+)([KMGT]?)$", re.IGNORECASE)
_MB_PER_UNIT = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}  # a bare number: MB, as Slurm reads it
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_NAMES = re.compile(r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*$")
# One entry of a Slurm host list: a name, possibly with numeric ranges in brackets (node[01-04,7]).
_HOST = re.compile(r"^(?:[A-Za-z0-9_.-]|\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\])+$")
_HOST_ENTRY = re.compile(r"(?:[^,\[]|\[[^\]]*\])+")
_RANGE = re.compile(r"\[([^\]]*)\]")
# Slurm feature expressions: names joined by & (and), | (or), [..] (matching or), *N counts.
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.:&|*\[\]()-]+$")
# A job id as Slurm (123, 123_4, with after's +minutes) or PBS (123.server, 123[].server) writes it.
JOB_ID = r"\d+(?:_\d+|\[\d*\])?(?:\.[A-Za-z0-9_-][A-Za-z0-9_.-]*)?(?:\+\d+)?"
_CONDITION = re.compile(rf"^({'|'.join(DEPENDENCY_TYPES)})((?::{JOB_ID})+)$")
_MAIL_USER = re.compile(r"^[A-Za-z0-9_.+-]+(?:@[A-Za-z0-9.-]+)?$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_HOSTS = 4096


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def hosts(entries: list[str]) -> list[str]:
    """A Slurm host list's entries, ranges expanded: ``["node[1-3]"]`` -> node1, node2, node3 (zero padding kept)."""
    names: list[str] = []
    for entry in entries:
        found = _RANGE.search(entry)
        if not found:
            names.append(entry)
            continue
        for part in found[1].split(","):
            low, _, high = part.partition("-")
            for number in range(int(low), int(high or low) + 1):
                names += hosts([f"{entry[:found.start()]}{number:0{len(low)}d}{entry[found.end():]}"])
    return names


def _host_count(entry: str) -> int:
    """How many names ``entry`` expands to (without expanding it: node[1-99999999] stays cheap)."""
    count = 1
    for ranges in _RANGE.findall(entry):
        spans = [part.partition("-") for part in ranges.split(",")]
        count *= sum(int(high or low) - int(low) + 1 if int(high or low) >= int(low) else MAX_HOSTS + 1
                     for low, _, high in spans)
    return count


def _one_line(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError("must not contain newlines or other control characters")
    return value


class SchedulerOptions(_Strict):
    """Scheduler options from the command line; they win over a preset's ``directives``."""

    mem: str | None = Field(None, description="memory per node: 16G, 500M, 0 (Slurm: all of it)")
    constraint: str | None = Field(None, description="node features, Slurm's syntax (a100&ib)")
    exclude: list[str] = Field(default_factory=list, description="nodes not to use (Slurm host list entries)")
    nodelist: list[str] = Field(default_factory=list, description="nodes the job must run on")
    qos: str | None = Field(None, description="quality of service")
    reservation: str | None = Field(None, description="reservation to run in")
    dependency: str | None = Field(None, description="afterok:ID[:ID][,TYPE:ID...] or singleton")
    mail_type: list[str] = Field(default_factory=list, description="events mailed about (Slurm's names)")
    mail_user: str | None = Field(None, description="who gets the mail")
    directives: list[str] = Field(default_factory=list, description="raw options, without #SBATCH/#PBS")
    cpus_per_task: int | None = Field(None, ge=1, description="CPUs per task, over the preset's rule")

    @field_validator("mem")
    @classmethod
    def _mem(cls, value: str | None) -> str | None:
        found = _MEM.match(value or "0")
        if not found:
            raise ValueError("must be a whole number with an optional unit K, M, G or T (16G, 500M; 0: all of a node)")
        return None if value is None else found[1] + found[2].upper()

    @property
    def mem_mb(self) -> int | None:
        """``--mem`` in MB (0: all of a node's memory); None when not asked for."""
        if self.mem is None:
            return None
        number, unit = _MEM.match(self.mem).groups()  # type: ignore[union-attr]  # validated above
        return int(int(number) * _MB_PER_UNIT[unit])

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, value: str | None) -> str | None:
        if value is not None and not _CONSTRAINT.match(value):
            raise ValueError("must be feature names joined by & (and), | (or), [..] and *N, as Slurm writes them")
        return value

    @field_validator("exclude", "nodelist")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        if not value:
            return value
        entries = [entry for text in value for entry in _HOST_ENTRY.findall(text)]
        split_whole = all(",".join(_HOST_ENTRY.findall(text)) == text for text in value)
        for entry in entries if split_whole and entries else [""]:
            if not _HOST.match(entry) or _host_count(entry) > MAX_HOSTS:
                raise ValueError(f"must be node names, comma-separated, with [1-4,7] ranges (node[01-04]), at most "
                                 f"{MAX_HOSTS} nodes")
        return entries

    @field_validator("qos")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not _NAME.match(value):
            raise ValueError("must be letters, digits, '_', '.' and '-'")
        return value

    @field_validator("reservation")
    @classmethod
    def _names(cls, value: str | None) -> str | None:
        if value is not None and not _NAMES.match(value):
            raise ValueError("must be names of letters, digits, '_', '.' and '-', comma-separated")
        return value

    @field_validator("dependency")
    @classmethod
    def _dependency(cls, value: str | None) -> str | None:
        if value is None or value == "singleton":
            return value
        separators = set(re.findall(r"[,?]", value))
        conditions = re.split(r"[,?]", value)
        if len(separators) > 1 or not all(_CONDITION.match(condition) for condition in conditions):
            raise ValueError(f"must be TYPE:JOBID[:JOBID] conditions joined by ',' (all) or '?' (any), TYPE one of "
                             f"{', '.join(DEPENDENCY_TYPES)}; or singleton")
        return value

    @field_validator("mail_type")
    @classmethod
    def _mail_type(cls, value: list[str]) -> list[str]:
        types = [name.strip().upper() for text in value for name in text.split(",")]
        for name in types:
            if name not in MAIL_TYPES:
                raise ValueError(f"must be one or more of {', '.join(MAIL_TYPES)}, comma-separated")
        return list(dict.fromkeys(types))

    @field_validator("mail_user")
    @classmethod
    def _mail_user(cls, value: str | None) -> str | None:
        if value is not None and not _MAIL_USER.match(value):
            raise ValueError("must be a user name or an address, user@host")
        return value

    @field_validator("directives")
    @classmethod
    def _directives(cls, value: list[str]) -> list[str]:
        for line in value:
            _one_line(line)
            if line.startswith("#"):
                raise ValueError("is written without the #SBATCH or #PBS prefix")
            if not line.startswith("-"):
                raise ValueError("must be an option of sbatch or qsub, starting with '-'")
        return value


class PythonEnv(_Strict):
    """The Python environment ``launch`` ran from, which the job activates."""

    kind: Literal["venv", "conda"]
    prefix: str = Field(description="its directory (sys.prefix)")
    conda_exe: str | None = Field(None, description="the conda program whose shell hook activates it")

    @field_validator("prefix", "conda_exe")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        if value is not None and not _one_line(value).startswith("/"):
            raise ValueError("must be an absolute path")
        return value


def _shell_line(line: str) -> str:
    """``line`` unchanged; ValueError when it is empty or bash cannot read it (it goes into the script as it is:
    a line bash cannot read would end the job at its start)."""
    import subprocess

    if not _one_line(line).strip():
        raise ValueError("must not be empty")
    try:
        checked = subprocess.run(["bash", "-n", "-c", line], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return line  # no bash here to ask (the cluster's still runs the script)
    if checked.returncode != 0:
        error = (checked.stderr.strip().splitlines() or ["a syntax error"])[0]
        raise ValueError(f"is not a line bash can read ({re.sub(r'^bash: -c: (line 1: )?', '', error)})")
    return line


def _software_line(entry: tuple[str, str]) -> tuple[str, str]:
    kind, text = entry
    if kind == "setup":
        _shell_line(text)
    elif not _one_line(text).strip():
        raise ValueError("must not be empty")
    return entry


# One --module NAME or --setup LINE: ("module", NAME) or ("setup", LINE), checked one by one so that an
# error names the entry; a list of them keeps the order they were typed in.
SoftwareLine = Annotated[tuple[Literal["module", "setup"], str], AfterValidator(_software_line)]


class Software(_Strict):
    """The job's software from the command line; added to the preset's ``modules``/``setup``/``container``."""

    lines: list[SoftwareLine] = Field(default_factory=list, description="--module and --setup in the order "
                                      "typed, after the preset's: (\"module\", NAME) or (\"setup\", LINE)")
    container: str | None = Field(None, description="image the job runs in, over the preset's")
    container_binds: list[str] = Field(default_factory=list, description="bind mounts SRC[:DST], added")
    container_setup: list[Annotated[str, AfterValidator(_shell_line)]] = Field(
        default_factory=list, description="shell lines run inside the container, after the preset's")
    python_env: PythonEnv | None = Field(None, description="environment activated in the job script")

    @field_validator("container")
    @classmethod
    def _image(cls, value: str | None) -> str | None:
        if value is not None and not _one_line(value).strip():
            raise ValueError("must name an image")
        return value

    @field_validator("container_binds")
    @classmethod
    def _binds(cls, value: list[str]) -> list[str]:
        for bind in value:
            if "," in _one_line(bind) or not bind.strip() or bind.startswith(":"):
                raise ValueError("must be SRC[:DST] without commas (one bind per flag)")
        return value
