"""How pytest-xdist deals the suite to its workers (``-n 2`` in pyproject.toml): whole files, never split.

A module-scoped run then starts once, not once per worker. Files that share a session-scoped run
or the local Slurm cluster form one group, so that run or cluster starts once too. The slowest
groups go first, so that no long group starts last while the other worker sits idle.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest

# Files sharing a session fixture -> the group that keeps them on one worker.
SHARED_FIXTURES = {
    "test_fsdp.py": "ddp_references", "test_deepspeed.py": "ddp_references",
    "test_plan_state_bytes.py": "ddp_references",  # and the FSDP and ZeRO runs of tests/shared_runs.py
    "test_training.py": "uninterrupted_two_rank_run", "test_restarts.py": "uninterrupted_two_rank_run",
    "test_launch_schedulers.py": "slurm_cluster", "test_converted_scripts.py": "slurm_cluster",
    "test_tutorial.py": "slurm_cluster", "test_preemption.py": "slurm_cluster",
    "test_launch_frameworks.py": "slurm_cluster", "test_rank_logs.py": "slurm_cluster",
    "test_job_restarts.py": "slurm_cluster", "test_sweep_view.py": "slurm_cluster",
    "test_sweep_slurm.py": "slurm_cluster", "test_scaling_study_slurm.py": "slurm_cluster",
}
# Seconds each group took on 2 cores (for the order only: a stale figure costs a few seconds, not a failure).
# Groups not listed are quick and go after these.
SECONDS = {
    "ddp_references": 420, "slurm_cluster": 350, "uninterrupted_two_rank_run": 170, "test_language_models.py": 60,
    "test_engine_api.py": 95, "test_tensor_parallel.py": 40, "test_watchdog.py": 40, "test_user_plugins.py": 40,
    "test_bench_comm.py": 40, "test_activation_checkpointing.py": 35, "test_shards.py": 55,
    "test_stop_contract.py": 55, "test_launcher_death.py": 30, "test_one_error.py": 20,
}


def group_of(nodeid: str) -> str:
    """The work unit of a test: its file's shared-fixture group, else its file."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    return SHARED_FIXTURES.get(name, name)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not getattr(self, "_slowest_first", False):
                ordered = sorted(self.workqueue.items(), key=lambda item: -SECONDS.get(item[0], 0))
                self.workqueue = OrderedDict(ordered)
                self._slowest_first = True
            super()._assign_work_unit(node)

    return SharedFixtureScheduling(config, log)
