"""The schedulers by name, as ``--scheduler`` and the job log name them."""

from __future__ import annotations

from nodescale.launch.schedulers.base import Scheduler
from nodescale.launch.schedulers.batch import BatchScheduler
from nodescale.launch.schedulers.local import Local
from nodescale.launch.schedulers.pbs import Pbs
from nodescale.launch.schedulers.slurm import Slurm

# The schedulers that queue jobs: the ones ``nodescale jobs`` and ``cancel`` ask.
BATCH: dict[str, BatchScheduler] = {"slurm": Slurm(), "pbs": Pbs()}
SCHEDULERS: dict[str, Scheduler] = {"local": Local(), **BATCH}
