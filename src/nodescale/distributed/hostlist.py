"""Host lists as schedulers write them: Slurm's compressed syntax and PBS/MPI node files.

Slurm hands every task its nodes as a compressed *hostlist* (``SLURM_JOB_NODELIST=gpu[001-004]``);
PBS Pro writes one line per slot to ``$PBS_NODEFILE``. Both are turned into a plain list of host
names here, in the scheduler's own order, because the first host of that order is where rank 0
runs and therefore where the rendezvous store lives.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from nodescale.errors import UserError

# A typo such as "n[1-9999999]" must fail fast rather than build millions of names.
MAX_HOSTS = 100_000

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_MPICH_SLOTS = re.compile(r"([^:]+):\d+")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist into host names, in Slurm's order.

    ``"node[001-003,007],gpu-a[1-2]x"`` gives node001, node002, node003, node007, gpu-a1x,
    gpu-a2x. Zero padding follows the lower bound of a range (``[08-10]`` gives 08, 09, 10);
    several bracket groups in one name expand as a cartesian product with the last group
    varying fastest (``r[1-2]n[01-02]`` gives r1n01, r1n02, r2n01, r2n02), which is what
    ``scontrol show hostnames`` prints. Commas inside brackets separate numbers, not hosts;
    empty entries (``"a,,b"``) are skipped as Slurm skips them. Duplicates are kept.

    Text after the last bracket (``gpu-a[1-2]x``) is accepted although Slurm 22.05's own
    parser rejects it: sites with such names exist, and accepting more than Slurm emits is
    harmless.

    Raises :class:`UserError` naming the string when it is malformed.
    """
    hosts: list[str] = []
    for entry in _split_top_level(hostlist):
        entry = entry.strip()
        if not entry:
            continue
        hosts.extend(_expand_entry(entry, hostlist))
        if len(hosts) > MAX_HOSTS:
            raise _malformed(hostlist, f"expands to more than {MAX_HOSTS} hosts")
    return hosts


def read_nodefile(path: str | Path) -> list[str]:
    """The distinct hosts of a PBS node file or MPI hostfile, in first-seen order.

    PBS writes one line per slot (a host with 4 slots appears 4 times); those repeats
    collapse to one entry. Blank lines and ``#`` comments are ignored. Open MPI's
    ``host slots=4`` and MPICH's ``host:4`` forms give ``host``.

    Raises :class:`UserError` if the file cannot be read or names no host.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UserError(
            f"node file {str(path)!r}",
            f"cannot be read ({exc.strerror or exc})",
            "check that PBS_NODEFILE (or the hostfile you passed) points at an existing file",
        ) from exc
    hosts: dict[str, None] = {}  # an ordered set
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host = line.split()[0]
        mpich = _MPICH_SLOTS.fullmatch(host)
        if mpich:
            host = mpich.group(1)
        hosts.setdefault(host, None)
    if not hosts:
        raise UserError(f"node file {str(path)!r}", "names no host", "the file is empty or only comments")
    return list(hosts)


def _split_top_level(hostlist: str) -> list[str]:
    """Split on the commas that are outside brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, char in enumerate(hostlist):
        if char == "[":
            depth += 1
            if depth > 1:
                raise _malformed(hostlist, "brackets cannot be nested")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise _malformed(hostlist, "']' without a matching '['")
        elif char == "," and depth == 0:
            parts.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise _malformed(hostlist, "'[' without a matching ']'")
    parts.append(hostlist[start:])
    return parts


def _expand_entry(entry: str, hostlist: str) -> list[str]:
    """Expand one host pattern such as ``r[1-2]n[01,03]-ib``."""
    # re.split with a capturing group alternates literal text and bracket contents.
    pieces = re.split(r"\[([^\]]*)\]", entry)
    choices: list[list[str]] = []
    for index, piece in enumerate(pieces):
        if index % 2 == 0:
            if any(c.isspace() for c in piece):
                raise _malformed(hostlist, f"host name {entry!r} contains white space")
            choices.append([piece])
        else:
            choices.append(_expand_group(piece, hostlist))
    count = 1
    for options in choices:
        count *= len(options)
    if count > MAX_HOSTS:
        raise _malformed(hostlist, f"expands to more than {MAX_HOSTS} hosts")
    return ["".join(parts) for parts in itertools.product(*choices)]


def _expand_group(group: str, hostlist: str) -> list[str]:
    """Expand the inside of one bracket: ``001-003,007`` -> 001, 002, 003, 007."""
    if not group:
        raise _malformed(hostlist, "empty brackets '[]'")
    numbers: list[str] = []
    for item in group.split(","):
        match = _RANGE.fullmatch(item)
        if not match:
            raise _malformed(hostlist, f"{item!r} is not a number or a range like 01-04")
        low, high = match.group(1), match.group(2)
        if high is None:
            numbers.append(low)
            continue
        if int(high) < int(low):
            raise _malformed(hostlist, f"range {item!r} runs backwards")
        if int(high) - int(low) >= MAX_HOSTS:
            raise _malformed(hostlist, f"range {item!r} has more than {MAX_HOSTS} numbers")
        # Slurm pads to the width of the lower bound: [08-10] -> 08 09 10, [8-10] -> 8 9 10.
        width = len(low)
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return numbers


def _malformed(hostlist: str, rule: str) -> UserError:
    return UserError(
        f"host list {hostlist!r}",
        rule,
        "write it as Slurm does, e.g. 'node[001-004,007],gpu[1-2]'",
    )
