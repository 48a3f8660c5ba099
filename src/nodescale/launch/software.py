"""The job's software from the command line (``--container``, ...), the submitting Python environment, and
the warning for a cluster whose PyTorch lives only in containers.

``--module`` and ``--setup`` lines are added to the preset's by :func:`nodescale.launch.shell.software_block`;
the container, with its ``--container-setup`` lines, is merged into the preset here, so that every launch
line uses it unchanged.
"""

from __future__ import annotations

import os
import shlex
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path

from nodescale.errors import UserError
from nodescale.launch.job_options import PythonEnv
from nodescale.launch.spec import Container, JobSpec, Preset


def job_preset(spec: JobSpec, preset: Preset) -> Preset:
    """``preset`` with the job's ``--container`` image (over the preset's), and its ``--container-bind`` mounts
    and ``--container-setup`` lines added after the preset's."""
    software = spec.software
    if software.container is None and not software.container_binds and not software.container_setup:
        return preset
    base = preset.container or Container(image=software.container or "")
    if not base.image:
        flag, value = (("--container-bind", software.container_binds[0]) if software.container_binds
                       else ("--container-setup", software.container_setup[0]))
        raise UserError(f"{flag} {shlex.quote(value)}", f"{preset.name} runs no container",
                        "name the image with --container IMAGE")
    container = base.model_copy(update={"image": software.container or base.image,
                                        "binds": [*base.binds, *software.container_binds],
                                        "setup": [*base.setup, *software.container_setup]})
    return preset.model_copy(update={"container": container})


def warn_without_container(spec: JobSpec, preset: Preset) -> None:
    """Warn when the cluster's PyTorch comes only in containers and the job names none."""
    if preset.container_required and preset.container is None and spec.software.container is None:
        warnings.warn(f"{preset.name} has PyTorch only inside containers and this job runs none: the job would find "
                      f"no torch. Add --container IMAGE.sif (and --container-bind), or a container in your own "
                      f"{preset.name} preset (`nodescale clusters`)", stacklevel=2)


def submitting_python_env(environ: Mapping[str, str] | None = None, prefix: str | None = None,
                          base_prefix: str | None = None) -> PythonEnv | None:
    """The venv or conda environment this nodescale runs from, for the job to activate; None for a system Python.

    ``sys.prefix`` first: it is the environment that holds this nodescale, whatever ``VIRTUAL_ENV`` says
    (a venv's python run by its path sets none).
    """
    environ = os.environ if environ is None else environ
    prefix = sys.prefix if prefix is None else prefix
    base_prefix = sys.base_prefix if base_prefix is None else base_prefix
    candidates = [prefix] if prefix != base_prefix else []
    candidates += [path for path in (environ.get("VIRTUAL_ENV"), environ.get("CONDA_PREFIX"), prefix) if path]
    for path in dict.fromkeys(candidates):
        if Path(path, "bin", "activate").is_file() and Path(path, "pyvenv.cfg").is_file():
            return PythonEnv(kind="venv", prefix=os.path.abspath(path))
        if Path(path, "conda-meta").is_dir():
            conda_exe = environ.get("CONDA_EXE")
            return PythonEnv(kind="conda", prefix=os.path.abspath(path),
                             conda_exe=os.path.abspath(conda_exe) if conda_exe else None)
    return None
