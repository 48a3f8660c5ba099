"""What a job is: the typed objects every renderer and submitter works from.

``JobSpec`` says what the user asked for (nodes, processes, time, command);
``Preset`` says what a cluster is like (scheduler, GPUs per node, modules,
environment). Renderers are pure functions of the two. Nothing here imports
torch or touches the file system.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nodescale.launch.job_options import SchedulerOptions, Software
from nodescale.launch.stop_handler import DEFAULT_MAX_REQUEUES, Handler

Scheduler = Literal["local", "slurm", "pbs"]
Mode = Literal["torchrun", "per-gpu", "spawn"]

_TIME = re.compile(r"^(\d+-)?\d{1,3}:[0-5]\d:[0-5]\d$")  # minutes and seconds below 60


def walltime_seconds(text: str) -> int:
    """``"1-12:00:00"`` or ``"36:00:00"`` -> seconds; ValueError for anything else."""
    if not _TIME.match(text):
        raise ValueError(f"{text!r} is not HH:MM:SS or D-HH:MM:SS with minutes and seconds below 60")
    days, _, clock = text.rpartition("-")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Container(Strict):
    """A container the job runs in (LUMI's Singularity images, say)."""

    runtime: Literal["singularity", "apptainer"] = Field(
        "singularity", description="container runtime command")
    image: str = Field(description="path of the .sif image on the cluster")
    binds: list[str] = Field(default_factory=list, description="bind mounts, SRC[:DST]")
    setup: list[str] = Field(default_factory=list, description="shell lines run inside the container first")


class Preset(Strict):
    """One cluster: how its jobs are asked for and what their nodes hold."""

    name: str
    description: str = ""
    scheduler: Literal["slurm", "pbs"]
    gpus_per_node: int = Field(ge=0, description="accelerators per node (GPUs, or GCDs on LUMI)")
    cpus_per_node: int = Field(ge=1, description="CPU cores per node available to jobs")
    gpu_request: Literal["gres", "gpus-per-node", "pbs-ngpus", "none"] = Field(
        "gpus-per-node", description="how GPUs are requested: --gres=gpu:TYPE:N, --gpus-per-node=N, ngpus=N")
    gpu_type: str | None = Field(None, description="GPU type for --gres=gpu:TYPE:N (e.g. v100)")
    queue: str | None = Field(None, description="default partition (Slurm) or queue (PBS)")
    account_required: bool = Field(False, description="the cluster rejects jobs without an account")
    max_time: str | None = Field(None, description="longest wall time the default queue allows, HH:MM:SS")
    directives: list[str] = Field(default_factory=list, description="extra #SBATCH/#PBS lines, without the prefix")
    modules: list[str] = Field(default_factory=list, description="modules loaded before the job runs")
    setup: list[str] = Field(default_factory=list, description="shell lines run before launching")
    env: dict[str, str] = Field(default_factory=dict, description="environment variables of every job")
    mpiexec: Literal["pals", "mpich", "openmpi"] = Field(
        "pals", description="PBS: the mpiexec flavour that starts one process per node or per GPU")
    cpu_bind: str | None = Field(None, description="CPU binding for the launcher (e.g. none, or LUMI's masks)")
    container: Container | None = None
    container_required: bool = Field(False, description="PyTorch exists here only inside a container: a job "
                                     "without one is warned about")
    # What `nodescale plan` prices a node by; absent where no public source says (plan then asks for it).
    gpu_model: str | None = Field(None, description="the GPU as torch names it, a bench/peaks.yaml name "
                                  "(e.g. NVIDIA A100-SXM4-40GB)")
    gpu_memory_gb: float | None = Field(None, gt=0, description="memory of one GPU in GB, as its datasheet says")
    interconnect_gbps: float | None = Field(None, gt=0, description="network bandwidth of one node, GB/s per "
                                            "direction, all its NICs together")
    max_array_size: int | None = Field(None, ge=1, description="most members one array job may have (Slurm's "
                                       "MaxArraySize, PBS's max_array_size), where the site says")


class JobArray(Strict):
    """The sweep members one array job runs (nodescale.launch.sweep); each runs the job's command as itself."""

    indices: list[int] = Field(min_length=1, description="member indices, ascending")
    max_concurrent: int | None = Field(None, ge=1, description="members running at once at most")
    sweep_dir: Path = Field(description="the sweep's directory: sweep.json, status/INDEX")


class JobSpec(Strict):
    """One job as the user asked for it, after validation."""

    scheduler: Scheduler
    preset: str
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(ge=0)
    nproc_per_node: int = Field(ge=1, description="processes per node (GPUs per node, or CPU processes)")
    mode: Mode = "torchrun"
    time: str = Field("01:00:00", description="wall time, HH:MM:SS or D-HH:MM:SS")
    account: str | None = None
    queue: str | None = None
    job_name: str = "nodescale"
    env: dict[str, str] = Field(default_factory=dict, description="user --env, merged over the preset's")
    command: list[str] = Field(min_length=1)
    stop_handler: Handler = Field(
        "nodescale", description="who acts on the stop signal sent ahead of the wall time: nodescale's ranks "
        "(checkpoint, requeue marker, the script requeues), a framework that requeues itself, or nobody (no "
        "signal is sent); nodescale.launch.stop_handler")
    max_requeues: int = Field(DEFAULT_MAX_REQUEUES, ge=0, description="requeues the job script makes at most "
                              "(nodescale handler)")
    stop_warning_s: int = Field(120, ge=0, description="seconds before the wall time the ranks are told to stop")
    max_restarts: int = Field(0, ge=0, description="Slurm/PBS/local: run the step again this often after a failure "
                              "(not after a user error); the ranks resume from the newest checkpoint")
    spare_nodes: int = Field(0, ge=0, description="Slurm: nodes asked for on top of --nodes, that take a failed "
                             "node's place on restart")
    workdir: Path = Field(description="directory the job runs in (cd there first)")
    job_dir: Path = Field(description="where the script and the logs go")
    options: SchedulerOptions = Field(default_factory=SchedulerOptions, description="--mem, --qos, ... over the "
                                      "preset's directives")
    software: Software = Field(default_factory=Software, description="--module, --setup, --container, and the "
                               "submitting Python environment")
    array: JobArray | None = Field(None, description="a sweep's members as one array job (--sweep)")
    after_step: list[str] = Field(default_factory=list, description="a command the batch shell runs once the step "
                                  "has ended, whatever its exit code: a scaling study's collect (after_step.py)")

    @field_validator("time")
    @classmethod
    def _time_format(cls, value: str) -> str:
        if not _TIME.match(value):
            raise ValueError("must look like HH:MM:SS or D-HH:MM:SS, minutes and seconds below 60")
        return value

    @property
    def requeue(self) -> bool:
        """Whether the job is sent the stop signal before its wall time (and so may be requeued)."""
        return self.stop_handler != "none"

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node
