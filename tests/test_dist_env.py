"""detect(), port_for_job(), expand_hostlist() and read_nodefile(), on recorded environments.

The Slurm, Open MPI, MPICH and srun+torchrun environments below are the variables real
launchers set (Slurm 22.05 with two nodes on localhost, Open MPI 4.1 and MPICH 4.0 from
Debian 12), trimmed to the ones that matter; the PALS one follows what Cray PALS and PBS Pro set
on NCAR Derecho.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nodescale.distributed.env import DistEnv, detect, port_for_job
from nodescale.distributed.hostlist import expand_hostlist, read_nodefile
from nodescale.errors import UserError

# --- recorded environments -------------------------------------------------------------------

# `sbatch -N2 --ntasks-per-node=2`: the batch script itself. It has SLURM_PROCID=0 and
# SLURM_NTASKS=4 but is not a task of any step: no SLURM_STEP_ID.
SLURM_BATCH = {
    "SLURMD_NODENAME": "node1", "SLURM_GTIDS": "0", "SLURM_JOBID": "1", "SLURM_JOB_ID": "1",
    "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_LOCALID": "0",
    "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_NODELIST": "node[1-2]", "SLURM_NPROCS": "4",
    "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "0",
    "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NAME": "job.sh",
}

# `srun` inside that script: task 2 of 4, on the second node.
SLURM_TASK_2 = {
    **SLURM_BATCH,
    "SLURMD_NODENAME": "node2", "SLURM_GTIDS": "2,3", "SLURM_NODEID": "1", "SLURM_PROCID": "2",
    "SLURM_SRUN_COMM_HOST": "127.0.0.1", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}

# `srun -N1 -n1` inside the same script: SLURM_NTASKS_PER_NODE=2 and SLURM_NODELIST are stale
# (the job's), the step's own variables are right.
SLURM_SUBSTEP = {
    **SLURM_BATCH,
    "SLURM_NNODES": "1", "SLURM_NPROCS": "1", "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1",
    "SLURM_SRUN_COMM_HOST": "127.0.0.1", "SLURM_STEPID": "1", "SLURM_STEP_ID": "1",
    "SLURM_STEP_NODELIST": "node1", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_STEP_TASKS_PER_NODE": "1",
}

# `srun -N2 -n3` straight from the login node: uneven tasks per node, no SLURM_NTASKS_PER_NODE.
SLURM_UNEVEN_RANK_2 = {
    "SLURMD_NODENAME": "node2", "SLURM_GTIDS": "2", "SLURM_JOBID": "2", "SLURM_JOB_ID": "2",
    "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_LOCALID": "0",
    "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NODELIST": "node[1-2]", "SLURM_NPROCS": "3",
    "SLURM_NTASKS": "3", "SLURM_PROCID": "2", "SLURM_SRUN_COMM_HOST": "127.0.0.1",
    "SLURM_STEPID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "2,1",
    "SLURM_TASKS_PER_NODE": "2,1",
}

# `srun -N2 --ntasks-per-node=1 torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d ...`:
# worker RANK=3 runs under the Slurm task 0 of 2.
SRUN_TORCHRUN_RANK_3 = {
    "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "localhost", "MASTER_PORT": "46363", "RANK": "3", "ROLE_NAME": "default",
    "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "4", "WORLD_SIZE": "4",
    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    "SLURM_JOB_ID": "4", "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
    "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}

# Open MPI `mpirun -n 4` inside `sbatch -N2 --ntasks-per-node=2`: mpirun started one daemon per
# node with srun, so MPI rank 1 carries that step's SLURM_PROCID=0 of SLURM_STEP_NUM_TASKS=2.
OMPI_IN_SLURM_RANK_1 = {
    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_MCA_orte_launch": "1", "PMIX_RANK": "1", "PMIX_NAMESPACE": "1961558017",
    "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_LOCALID": "0",
    "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_PROCID": "0", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}

# MPICH (Hydra) `mpiexec -n 4` in the same kind of job: rank 3 inherits Slurm task 1 of 2.
MPICH_IN_SLURM_RANK_3 = {
    "MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "1", "PMI_FD": "6", "PMI_RANK": "3", "PMI_SIZE": "4",
    "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_LOCALID": "0",
    "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_PROCID": "1", "SLURM_STEPID": "1", "SLURM_STEP_ID": "1",
    "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}

# Open MPI `mpirun -n 2` and MPICH `mpiexec -n 2` on one machine, outside any scheduler.
OMPI_LOCAL_RANK_1 = {
    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
    "PMIX_RANK": "1", "PMIX_HOSTNAME": "vm",
}
MPICH_LOCAL_RANK_1 = {"MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "1", "PMI_FD": "8", "PMI_RANK": "1",
                      "PMI_SIZE": "2"}

# Derecho: `mpiexec -n 8 --ppn 4 python train.py` (Cray PALS) in a 2-node PBS Pro job; rank 5.
PBS_JOB = {
    "PBS_JOBID": "4185735.desched1", "PBS_JOBNAME": "resnet", "PBS_ENVIRONMENT": "PBS_BATCH",
    "PBS_O_WORKDIR": "/glade/u/home/user/run", "PBS_QUEUE": "main",
}
PALS_RANK_5 = {
    **PBS_JOB,
    "PALS_APID": "0e9c2d4a-5b8f-4d7e-9a61-3f1c7d2b8e40", "PALS_RANKID": "5", "PALS_LOCAL_RANKID": "1",
    "PALS_NODEID": "1", "PALS_LOCAL_SIZE": "4", "PALS_DEPTH": "1",
    "PALS_SPOOL_DIR": "/var/run/palsd/0e9c2d4a", "PMI_RANK": "5", "PMI_SIZE": "8",
    "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "4", "PMI_UNIVERSE_SIZE": "8",
}


def fake_resolver(table: dict[str, str] | None = None):
    """A resolver that knows only ``table`` and records what it was asked."""
    known = {"node1": "10.1.0.1", "node2": "10.1.0.2"} if table is None else table
    asked: list[str] = []

    def resolve(host: str) -> str:
        asked.append(host)
        if host not in known:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        return known[host]

    resolve.asked = asked  # type: ignore[attr-defined]
    return resolve


@pytest.fixture
def nodefile(tmp_path: Path) -> Path:
    """A Derecho PBS node file: one line per chunk, hosts in allocation order."""
    path = tmp_path / "4185735.desched1"
    path.write_text("dec0101.hsn.de.hpc.ucar.edu\ndec0102.hsn.de.hpc.ucar.edu\n")
    return path


# --- detectors ------------------------------------------------------------------------------


def test_slurm_task_of_a_step() -> None:
    env = detect(SLURM_TASK_2, resolve=fake_resolver())
    assert env == DistEnv(
        rank=2, local_rank=0, world_size=4, local_world_size=2, node_rank=1, num_nodes=2,
        master_addr="10.1.0.1", master_port=15001, source="slurm",
    )


def test_slurm_batch_script_is_not_a_task() -> None:
    # rank 0 "of 4" here would wait forever for three ranks nobody started.
    env = detect(SLURM_BATCH, resolve=fake_resolver())
    assert (env.source, env.rank, env.world_size) == ("single", 0, 1)
    assert env.master_addr == "127.0.0.1"
    assert env.master_port == port_for_job("1")  # still job-specific: two jobs may share a node


def test_salloc_shell_and_extern_step_are_not_tasks() -> None:
    salloc = {"SLURM_JOB_ID": "3", "SLURM_JOB_NAME": "interactive", "SLURM_NNODES": "2",
              "SLURM_NODELIST": "node[1-2]", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "1(x2)"}
    assert detect(salloc).source == "single"
    special_step = {**SLURM_TASK_2, "SLURM_STEP_ID": "4294967291", "SLURM_STEPID": "4294967291"}
    assert detect(special_step).source == "single"


def test_slurm_substep_uses_step_variables_not_stale_job_ones() -> None:
    env = detect(SLURM_SUBSTEP, resolve=fake_resolver())
    assert (env.world_size, env.local_world_size, env.num_nodes) == (1, 1, 1)
    assert env.source == "slurm"


def test_slurm_uneven_tasks_per_node() -> None:
    env = detect(SLURM_UNEVEN_RANK_2, resolve=fake_resolver())
    assert (env.rank, env.local_rank, env.local_world_size, env.node_rank) == (2, 0, 1, 1)
    assert env.world_size == 3 and env.num_nodes == 2


def test_slurm_tasks_per_node_repeat_syntax() -> None:
    environ = {**SLURM_TASK_2, "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_STEP_NUM_TASKS": "11",
               "SLURM_STEP_NUM_NODES": "3", "SLURM_NODEID": "2", "SLURM_PROCID": "9",
               "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "node[1-3]"}
    env = detect(environ, resolve=fake_resolver())
    assert (env.local_world_size, env.node_rank, env.num_nodes) == (3, 2, 3)


def test_torchrun_wins_over_slurm_under_srun_torchrun() -> None:
    env = detect(SRUN_TORCHRUN_RANK_3, resolve=fake_resolver())
    assert env == DistEnv(
        rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, num_nodes=2,
        master_addr="localhost", master_port=46363, source="torchrun",
    )


def test_torchrun_standalone() -> None:
    environ = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "f3b2c1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41235"}
    env = detect(environ)
    assert (env.rank, env.world_size, env.num_nodes, env.source) == (1, 2, 1, "torchrun")


def test_hand_set_rank_variables_count_as_torchrun_style() -> None:
    # mp.spawn-style scripts and DeepSpeed's launcher set only these (DeepSpeed: LOCAL_SIZE).
    env = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2",
                  "MASTER_ADDR": "10.0.0.7"})
    assert (env.node_rank, env.num_nodes, env.local_world_size) == (1, 2, 2)
    assert env.master_addr == "10.0.0.7" and env.master_port == 29500
    one_node = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert one_node.master_addr == "127.0.0.1" and one_node.local_world_size == 2


def test_torchelastic_without_rank_is_an_error() -> None:
    with pytest.raises(UserError, match="RANK"):
        detect({"TORCHELASTIC_RUN_ID": "abc", "WORLD_SIZE": "2"})


def test_pals_on_derecho(nodefile: Path) -> None:
    resolve = fake_resolver({"dec0101.hsn.de.hpc.ucar.edu": "10.2.0.1"})
    env = detect({**PALS_RANK_5, "PBS_NODEFILE": str(nodefile)}, resolve=resolve)
    assert env == DistEnv(
        rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1, num_nodes=2,
        master_addr="10.2.0.1", master_port=port_for_job("4185735.desched1"), source="pals",
    )
    assert resolve.asked == ["dec0101.hsn.de.hpc.ucar.edu"]  # type: ignore[attr-defined]


def test_mpirun_inside_slurm_is_left_to_open_mpi() -> None:
    env = detect(OMPI_IN_SLURM_RANK_1, resolve=fake_resolver())
    assert (env.source, env.rank, env.world_size, env.local_rank) == ("openmpi", 1, 4, 1)
    assert (env.node_rank, env.num_nodes) == (0, 2)
    assert env.master_addr == "10.1.0.1"  # first host of the allocation
    assert env.master_port == port_for_job("5")


def test_hydra_mpiexec_inside_slurm_is_left_to_mpich() -> None:
    env = detect(MPICH_IN_SLURM_RANK_3, resolve=fake_resolver())
    assert (env.source, env.rank, env.world_size, env.local_rank, env.node_rank) == ("mpich", 3, 4, 1, 1)
    assert env.master_addr == "10.1.0.1"


def test_srun_with_pmi_that_agrees_stays_slurm() -> None:
    # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE equal to Slurm's own numbering.
    env = detect({**SLURM_TASK_2, "PMI_RANK": "2", "PMI_SIZE": "4", "PMI_FD": "5"}, resolve=fake_resolver())
    assert env.source == "slurm"


@pytest.mark.parametrize(
    ("environ", "source"), [(OMPI_LOCAL_RANK_1, "openmpi"), (MPICH_LOCAL_RANK_1, "mpich")]
)
def test_single_node_mpi_uses_loopback(environ: dict[str, str], source: str) -> None:
    resolve = fake_resolver()
    env = detect(environ, resolve=resolve)
    assert (env.source, env.rank, env.world_size, env.local_world_size) == (source, 1, 2, 2)
    assert env.master_addr == "127.0.0.1" and env.master_port == 29500
    assert resolve.asked == []  # type: ignore[attr-defined]


def test_multi_node_mpi_without_node_list_needs_master_addr() -> None:
    environ = {**OMPI_LOCAL_RANK_1, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3"}
    with pytest.raises(UserError, match="MASTER_ADDR") as info:
        detect(environ)
    assert info.value.hint and "MASTER_ADDR" in info.value.hint
    assert detect({**environ, "MASTER_ADDR": "10.9.9.9"}).master_addr == "10.9.9.9"


def test_mpich_without_local_rank_is_an_error() -> None:
    with pytest.raises(UserError, match="MPI_LOCALRANKID"):
        detect({"PMI_RANK": "0", "PMI_SIZE": "2"})


def test_nothing_set_is_a_single_process() -> None:
    assert detect({}) == DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", 29500, "single")


def test_default_environ_is_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID",
                 "PALS_RANKID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "23456")
    assert detect().master_port == 23456


# --- master address --------------------------------------------------------------------------


def test_master_addr_env_wins_over_node_list() -> None:
    resolve = fake_resolver()
    env = detect({**SLURM_TASK_2, "MASTER_ADDR": "10.7.7.7"}, resolve=resolve)
    assert env.master_addr == "10.7.7.7" and resolve.asked == []  # type: ignore[attr-defined]


def test_master_addr_is_first_host_of_step_node_list() -> None:
    resolve = fake_resolver({"gpu017": "10.3.0.17"})
    environ = {**SLURM_TASK_2, "SLURM_STEP_NODELIST": "gpu[017-018]", "SLURM_JOB_NODELIST": "gpu[001-018]"}
    assert detect(environ, resolve=resolve).master_addr == "10.3.0.17"
    assert resolve.asked == ["gpu017"]  # type: ignore[attr-defined]


def test_single_node_slurm_step_needs_no_lookup() -> None:
    resolve = fake_resolver({})
    assert detect(SLURM_SUBSTEP, resolve=resolve).master_addr == "127.0.0.1"
    assert resolve.asked == []  # type: ignore[attr-defined]


def test_unresolvable_first_host_names_it_and_hints_master_addr() -> None:
    with pytest.raises(UserError) as info:
        detect(SLURM_TASK_2, resolve=fake_resolver({}))
    assert "'node1'" in str(info.value)
    assert info.value.hint and "MASTER_ADDR" in info.value.hint


def test_default_resolver_error_is_a_user_error() -> None:
    environ = {**SLURM_TASK_2, "SLURM_STEP_NODELIST": "no-such-host-nodescale[1-2].invalid"}
    with pytest.raises(UserError, match="no-such-host-nodescale1.invalid"):
        detect(environ)


def test_unreadable_nodefile_is_a_user_error(tmp_path: Path) -> None:
    missing = tmp_path / "gone"
    with pytest.raises(UserError, match="gone"):
        detect({**PALS_RANK_5, "PBS_NODEFILE": str(missing)}, resolve=fake_resolver())


# --- master port -----------------------------------------------------------------------------


def test_port_is_the_same_for_every_rank_of_a_job() -> None:
    ranks = [SLURM_TASK_2, {**SLURM_TASK_2, "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0"}]
    ports = {detect(environ, resolve=fake_resolver()).master_port for environ in ranks}
    assert ports == {port_for_job("1")}


def test_port_differs_between_jobs_and_stays_in_range() -> None:
    ports = [port_for_job(str(job)) for job in range(1_000_000, 1_000_050)]
    assert len(set(ports)) == len(ports)
    assert all(15000 <= port < 30000 for port in ports)
    assert port_for_job("1234") == 15000 + 1234
    assert port_for_job("16234") == 15000 + 1234


def test_port_from_pbs_job_ids() -> None:
    assert port_for_job("1234.desched1") == port_for_job("1234")
    # Members of one array job, the likeliest to share a node, get different ports.
    assert port_for_job("1234[5].desched1") != port_for_job("1234[6].desched1")
    assert port_for_job("job-abc") == port_for_job("job-abc")  # stable, not Python's salted hash
    assert 15000 <= port_for_job("job-abc") < 30000


def test_port_without_job_id_is_torchruns_default() -> None:
    assert port_for_job(None) == 29500
    assert port_for_job("") == 29500


def test_master_port_env_wins() -> None:
    assert detect({**SLURM_TASK_2, "MASTER_PORT": "12345"}, resolve=fake_resolver()).master_port == 12345


@pytest.mark.parametrize("value", ["0", "65536", "http", "-1", "29500.0"])
def test_bad_master_port_is_a_user_error(value: str) -> None:
    with pytest.raises(UserError, match="MASTER_PORT") as info:
        detect({"MASTER_PORT": value})
    assert repr(value) in str(info.value)


# --- inconsistent values ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "RANK=4"),
        ({"RANK": "-1", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "RANK='-1'"),
        ({"RANK": "one", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "RANK='one'"),
        ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE='0'"),
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4"),
        ({**SLURM_TASK_2, "SLURM_PROCID": "4"}, "SLURM_PROCID=4"),
        ({**SLURM_TASK_2, "SLURM_STEP_NUM_TASKS": "4x"}, "SLURM_STEP_NUM_TASKS='4x'"),
        ({**SLURM_TASK_2, "SLURM_STEP_TASKS_PER_NODE": "2(x)"}, "SLURM_STEP_TASKS_PER_NODE='2(x)'"),
        ({**SLURM_TASK_2, "SLURM_NODEID": "2"}, "SLURM_NODEID=2"),
        ({**OMPI_LOCAL_RANK_1, "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, "OMPI_COMM_WORLD_LOCAL_RANK=2"),
        ({**MPICH_LOCAL_RANK_1, "PMI_SIZE": "two"}, "PMI_SIZE='two'"),
    ],
)
def test_inconsistent_values_name_the_variable(environ: dict[str, str], named: str) -> None:
    with pytest.raises(UserError) as info:
        detect(environ, resolve=fake_resolver())
    assert named in str(info.value)


# --- host lists ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node[001-003,007],gpu-a[1-2]x",
         ["node001", "node002", "node003", "node007", "gpu-a1x", "gpu-a2x"]),
        # The cases below were checked against `scontrol show hostnames` (Slurm 22.05).
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("n[1-2][3-4]", ["n13", "n14", "n23", "n24"]),
        ("n[01-02]a[7]", ["n01a7", "n02a7"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("n[09-11]", ["n09", "n10", "n11"]),
        ("n[001-3]", ["n001", "n002", "n003"]),
        ("n[2,1,1]", ["n2", "n1", "n1"]),
        ("x[0-0]", ["x0"]),
        ("a-b[1-2]", ["a-b1", "a-b2"]),
        ("a,,b", ["a", "b"]),
        (" n1 , n2", ["n1", "n2"]),
        ("node1", ["node1"]),
        ("", []),
        ("nid[001234-001235].hsn", ["nid001234.hsn", "nid001235.hsn"]),
    ],
)
def test_expand_hostlist(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    "hostlist",
    ["n[1-2", "n1-2]", "n[[1-2]]", "n[]", "n[a-b]", "n[3-1]", "n[1--2]", "n[1-2-3]", "n[-1]",
     "n[1,2-]", "n[ 1-2]", "n]1[", "bad host", "n[1-99999999]"],
)
def test_malformed_hostlist_names_the_string(hostlist: str) -> None:
    with pytest.raises(UserError) as info:
        expand_hostlist(hostlist)
    assert repr(hostlist) in str(info.value)


def test_nodefile_collapses_slots_in_first_seen_order(tmp_path: Path) -> None:
    path = tmp_path / "nodes"
    path.write_text("dec0107\ndec0107\ndec0103\n\ndec0107\ndec0103\ndec0110\n")
    assert read_nodefile(path) == ["dec0107", "dec0103", "dec0110"]


def test_nodefile_comments_and_hostfile_syntax(tmp_path: Path) -> None:
    path = tmp_path / "hostfile"
    path.write_text("# Open MPI hostfile\nnodeA slots=4 max_slots=8\n  nodeB   slots=4  # second\n"
                    "nodeC:2\nnodeA slots=4\n")
    assert read_nodefile(str(path)) == ["nodeA", "nodeB", "nodeC"]


def test_nodefile_missing_or_empty_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="nope"):
        read_nodefile(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(UserError, match="no host"):
        read_nodefile(empty)
