"""The PBS server's version, and whether it takes ``qsub -W max_run_subjobs`` (``launch --max-concurrent``).

PBS Professional gained ``max_run_subjobs`` in 2020.1, OpenPBS in 20.0. An older server rejects the
attribute only when ``qsub`` runs (or, worse, ignores it), so a sweep with ``--max-concurrent`` is refused
before anything is submitted. Where the version cannot be read (no ``qstat``, no server, no version in its
answer) the sweep goes ahead as rendered: the docs say which PBS it needs.
"""

from __future__ import annotations

import json
import re

from nodescale.errors import UserError
from nodescale.launch.partition_fit import Unreachable
from nodescale.launch.schedulers.client import client_output

_VERSION = re.compile(r"pbs_version\W+(\d+(?:\.\d+)*)")


def parse_version(text: str) -> str | None:
    """``pbs_version`` from ``qstat -B -f -F json`` (the server's, else the client's) or ``qstat --version``."""
    try:
        loaded = json.loads(text)
    except ValueError:
        loaded = None
    if isinstance(loaded, dict):
        servers = loaded.get("Server")
        found = [server.get("pbs_version") for server in servers.values() if isinstance(server, dict)] \
            if isinstance(servers, dict) else []
        found.append(loaded.get("pbs_version"))
        text = next((f"pbs_version = {version}" for version in found if version), "")
    match = _VERSION.search(text)
    return match[1] if match else None


def has_max_run_subjobs(version: str) -> bool:
    """PBS Professional numbers its releases by year since 2020 (2020.1, 2022.1); OpenPBS and the PBS Pro
    releases before them by major version (19.1.3, 20.0.1, 23.06)."""
    major, _, rest = version.partition(".")
    minor = int(rest.partition(".")[0] or 0)
    return (int(major), minor) >= (2020, 1) if int(major) >= 1000 else int(major) >= 20


def server_version() -> str | None:
    """This machine's PBS server's version; None where it cannot be asked or does not say."""
    for argv in (("qstat", "-B", "-f", "-F", "json"), ("qstat", "--version")):
        out = client_output(*argv)
        version = None if isinstance(out, Unreachable) else parse_version(out)
        if version:
            return version
    return None


def check_max_concurrent(max_concurrent: int | None) -> None:
    """UserError for ``--max-concurrent`` where the PBS server is older than max_run_subjobs."""
    if not max_concurrent:
        return
    version = server_version()
    if version is None or has_max_run_subjobs(version):
        return
    raise UserError(f"--max-concurrent {max_concurrent}",
                    f"becomes qsub -W max_run_subjobs, which needs PBS Professional 2020.1 or OpenPBS 20; "
                    f"this PBS server is version {version}",
                    "drop --max-concurrent (every member may then run at once), or split the sweep into "
                    "smaller launches")
