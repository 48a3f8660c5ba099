"""A scheduler client's answer, or why there was none: for reading the cluster, never for submitting."""

from __future__ import annotations

import shutil
import subprocess

from nodescale.launch.partition_fit import Unreachable


def client_output(*argv: str) -> str | Unreachable:
    """The stdout of ``argv`` (scontrol, pbsnodes, qstat); :class:`Unreachable` with the reason where it failed."""
    if shutil.which(argv[0]) is None:
        return Unreachable(f"{argv[0]} is not on PATH")
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Unreachable(f"{' '.join(argv)}: {exc}")
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip().splitlines()
        return Unreachable(f"{' '.join(argv)}: {said[-1] if said else f'exit {result.returncode}'}")
    return result.stdout
