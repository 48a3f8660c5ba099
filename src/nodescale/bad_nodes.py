"""The bad-node file: hosts a job should leave out, one ``HOST<TAB>REASON`` line each.

One list for every source: a Slurm job with ``--max-restarts``/``--spare-nodes`` keeps
``JOB_DIR/bad-nodes-JOBID.txt`` (named to its ranks by :data:`VARIABLE`), where the job script
adds a node whose processes srun reports killed, and where ``nodescale doctor`` and ``nodescale
bench comm --pairs`` add a node they flag; the next run of the step and the requeued job leave
those nodes out. Both tools also write ``OUT/bad-nodes.txt`` under their ``--out`` directory, and
``nodescale launch --exclude-from FILE`` reads either file for a later job (Slurm ``--exclude``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from nodescale.atomic_files import write_text_atomic
from nodescale.errors import UserError

FILE_NAME = "bad-nodes.txt"
VARIABLE = "NODESCALE_BAD_NODES_FILE"  # set by the job script; doctor and bench comm add to it
HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # what the job script's loop also accepts
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")
MAX_LINES = 4096
MAX_BYTES = 1 << 20  # read no further: a bad-node file is small


def parse(text: str, source: str) -> dict[str, str]:
    """The file's hosts and reasons (the first reason of a host repeated); ``#`` lines and blank lines skipped.

    >>> parse("node3\\tdoctor: slow\\n# note\\nnode1\\n", "f")
    {'node3': 'doctor: slow', 'node1': ''}
    """
    found: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        host, _, reason = line.partition("\t")
        host = host.strip()
        if not HOST.fullmatch(host):
            raise UserError(f"{source} line {number}: {line[:80]!r}", "must start with a node name (letters, digits, "
                            "'_', '.', '-'), then a tab and the reason",
                            "give the bad-nodes.txt that nodescale doctor or bench comm --pairs wrote")
        found.setdefault(host, reason.strip())
        if len(found) > MAX_LINES:
            raise UserError(f"{source}", f"names more than {MAX_LINES} nodes", "give the file doctor wrote")
    return found


def read(path: Path, flag: str = "--exclude-from") -> dict[str, str]:
    """The hosts in the file at ``path``; UserError naming ``flag`` when it cannot be read."""
    if not path.is_file():
        raise UserError(f"{flag} {str(path)!r}", "is not a file", "give the bad-nodes.txt under doctor's or bench "
                        "comm's --out directory")
    try:
        with path.open(encoding="utf-8") as handle:
            text = handle.read(MAX_BYTES)
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{flag} {str(path)!r}", f"cannot be read ({getattr(exc, 'strerror', None) or exc})",
                        "give the bad-nodes.txt under doctor's or bench comm's --out directory") from None
    return parse(text, f"{flag} {path}")


def lines(flagged: Mapping[str, str]) -> str:
    """The file's text: one ``HOST<TAB>REASON`` line per host, the reason on one line."""
    return "".join(f"{host}\t{_CONTROL.sub(' ', reason).strip()}\n" for host, reason in flagged.items())


def add(path: Path, flagged: Mapping[str, str]) -> None:
    """Add ``flagged`` to the file at ``path`` (hosts already there keep their reason), atomically."""
    try:
        known = parse(path.read_text(errors="replace"), str(path)) if path.exists() else {}
    except UserError:
        known = {}  # a damaged file is replaced rather than stopping the report
    write_text_atomic(path, lines({**known, **{h: r for h, r in flagged.items() if h not in known}}))


def record(flagged: Mapping[str, str], out_dir: Path | None, tool: str) -> list[str]:
    """Write the flagged hosts to ``out_dir/bad-nodes.txt`` and the job's file; one message line per host."""
    flagged = {host: reason for host, reason in flagged.items() if HOST.fullmatch(host)}
    if not flagged:
        return []
    job_file = os.environ.get(VARIABLE)
    written = []
    if out_dir is not None:
        add(out_dir / FILE_NAME, flagged)
        written.append(f"leave it out of a later Slurm job with nodescale launch --exclude-from {out_dir / FILE_NAME}")
    if job_file:
        add(Path(job_file), flagged)
        written.insert(0, "this job's next restart or requeue leaves it out")
    if not written:
        written.append("give --out DIR to record it for nodescale launch --exclude-from DIR/bad-nodes.txt")
    how = "; ".join(written) + " (PBS Pro cannot leave a host out: ask the admins to offline it)"
    return [f"nodescale {tool}: flagged node {host} ({reason}): {how}" for host, reason in flagged.items()]
