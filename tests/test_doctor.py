"""``nodescale doctor``: pure check functions on hand-made facts, then the real command.

The first part feeds :class:`RankFacts` built here to each check function (no processes). The
second part runs ``nodescale doctor`` in real processes with real torch.distributed on gloo:
a healthy ``--nproc 2`` run, a missing GLOO_SOCKET_IFNAME interface, a Slurm request the run
does not match, a misspelt NCCL variable, a rank that never comes, and two ranks started by
hand (the srun/mpiexec path, where rank 0 hosts the store).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from conftest import cli_env, free_port, run_cli
from nodescale.cli.doctor_cmd import parse_nproc, parse_timeout
from nodescale.distributed.rank_labels import rank_ranges
from nodescale.doctor import bandwidth, consistency, evaluate, launch_math, names, network
from nodescale.doctor.check import FAIL, OK, WARN, Check, exit_code, merge_rank_rows, worst
from nodescale.doctor.exchange import Exchange
from nodescale.doctor.facts import RankFacts, launcher_of
from nodescale.errors import UserError

multiproc = pytest.mark.multiproc

ETH0 = {"addresses": ["10.0.0.5"], "state": "up"}
LO = {"addresses": ["127.0.0.1"], "state": "unknown"}


def make_facts(rank: int = 0, world: int = 2, per_node: int = 2, **changes: Any) -> RankFacts:
    """One rank's facts as a healthy CPU job on ``world / per_node`` nodes would report them."""
    node = rank // per_node
    facts = RankFacts(
        rank=rank, local_rank=rank % per_node, world_size=world, local_world_size=per_node, node_rank=node,
        num_nodes=-(-world // per_node), source="torchrun", launcher="torchrun", host=f"node{node}", pid=100 + rank,
        master_addr="10.0.0.1", master_port=29500, master_resolved="10.0.0.1", address=f"10.0.0.{node + 1}",
        host_resolved=f"10.0.0.{node + 1}", cpu_affinity=[0, 1, 2, 3], cpu_count=4, torch_version="2.13.0",
        python_version="3.11.7", python_executable="/env/bin/python", backends_available=["gloo"],
        interfaces={"lo": LO, "eth0": {"addresses": [f"10.0.0.{node + 1}"], "state": "up"}},
    )
    return replace(facts, **changes)


def job(world: int = 2, per_node: int = 2, **changes: Any) -> dict[int, RankFacts]:
    return {rank: make_facts(rank, world, per_node, **changes) for rank in range(world)}


def only(rows: list[Check], name: str) -> Check:
    matching = [row for row in rows if row.name == name]
    assert len(matching) == 1, f"{name}: {rows}"
    return matching[0]


# --- rows -------------------------------------------------------------------------------------


def test_rank_ranges_compress_runs() -> None:
    assert rank_ranges([7, 0, 1, 2, 5, 8]) == "0-2,5,7-8"
    assert rank_ranges([]) == ""


def test_exit_code_is_one_only_when_a_row_failed() -> None:
    rows = [Check("a", OK, ""), Check("b", WARN, "", "h")]
    assert (worst(rows), exit_code(rows)) == (WARN, 0)
    assert exit_code([*rows, Check("c", FAIL, "", "h")]) == 1
    with pytest.raises(ValueError):
        Check("d", "bad", "")
    assert Check.from_dict(Check("e", FAIL, "x", "y", True).to_dict()) == Check("e", FAIL, "x", "y", True)


def test_identical_rows_of_several_ranks_merge_into_one() -> None:
    same = Check("x", OK, "fine")
    odd = Check("y", FAIL, "broken on node1", "fix")
    merged = merge_rank_rows({0: [same], 1: [same, odd], 2: [same, odd]}, world_size=3)
    assert [(row.name, row.detail) for row in merged] == [("x", "all ranks: fine"),
                                                         ("y", "ranks 1-2: broken on node1")]


def test_launcher_named_from_the_environment() -> None:
    assert launcher_of("torchrun", {"TORCHELASTIC_RUN_ID": "x"}) == "torchrun"
    assert launcher_of("torchrun", {"TORCHELASTIC_RUN_ID": "x", "NODESCALE_DOCTOR_VERDICT": "/f"}) == (
        "nodescale doctor --nproc")
    assert launcher_of("torchrun", {"SLURM_PROCID": "0"}) == "srun, with RANK/WORLD_SIZE per task"
    assert launcher_of("torchrun", {}) == "RANK/WORLD_SIZE set by hand"
    assert launcher_of("slurm", {}) == "srun"


# --- variable names ---------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "meant"), [
    ("NCCL_SOCKET_IFNAM", "NCCL_SOCKET_IFNAME"),  # one letter short
    ("NCCL_DEBUG_SUBSYSTEMS", "NCCL_DEBUG_SUBSYS"),  # the abbreviated word spelt out
    ("NCCL_IFNAME_SOCKET", "NCCL_SOCKET_IFNAME"),  # words reordered
    ("NCLL_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"),  # misspelt prefix
    ("GLOO_SOCKET_IFNAM", "GLOO_SOCKET_IFNAME"),
    ("FI_PROVIDERS", "FI_PROVIDER"),
])
def test_misspelt_variables_fail_with_did_you_mean(name: str, meant: str) -> None:
    selected = names.communication_variables({name: "eth0", "HOME": "/root"})
    assert selected == {name: "eth0"}
    row = only(names.check_variables(selected), f"env.{name}")
    assert (row.status, row.hint) == (FAIL, f"did you mean {meant}?")


def test_variable_name_in_the_wrong_case_fails() -> None:
    row = only(names.check_variables({"nccl_debug": "INFO"}), "env.nccl_debug")
    assert row.status == FAIL and row.hint == "write NCCL_DEBUG=INFO"


def test_unknown_family_name_old_name_and_bad_value() -> None:
    rows = names.check_variables({"NCCL_SOMETHING_NEW": "1", "NCCL_IB_GDR_LEVEL": "PHB", "NCCL_DEBUG": "LOUD"})
    assert only(rows, "env.NCCL_SOMETHING_NEW").status == WARN  # a newer NCCL may read it
    assert only(rows, "env.NCCL_IB_GDR_LEVEL").hint == "use NCCL_NET_GDR_LEVEL"
    assert only(rows, "env.NCCL_DEBUG").status == FAIL


def test_known_variables_pass_and_secrets_are_never_collected() -> None:
    environ = {"NCCL_DEBUG": "INFO", "FI_PROVIDER": "cxi", "GLOO_SOCKET_IFNAME": "eth0", "API_TOKEN": "secret"}
    selected = names.communication_variables(environ)
    assert "API_TOKEN" not in selected
    assert [row.status for row in names.check_variables(selected)] == [OK]


# --- network ----------------------------------------------------------------------------------


def test_missing_gloo_interface_fails_naming_it_and_the_host() -> None:
    facts = make_facts(comm_env={"GLOO_SOCKET_IFNAME": "nosuch0"})
    row = network.check_gloo_interfaces(facts, "gloo")
    assert row.status == FAIL and row.blocking
    assert "nosuch0" in row.detail and "node0" in row.detail and "eth0" in row.hint
    assert not network.check_gloo_interfaces(facts, "nccl").blocking  # not what the collective would use


def test_gloo_interface_without_address_fails_and_a_good_one_passes() -> None:
    facts = make_facts(comm_env={"GLOO_SOCKET_IFNAME": "ib0"},
                       interfaces={"eth0": ETH0, "ib0": {"addresses": [], "state": "down"}})
    assert network.check_gloo_interfaces(facts, "gloo").status == FAIL
    good = replace(facts, comm_env={"GLOO_SOCKET_IFNAME": "eth0"})
    assert network.check_gloo_interfaces(good, "gloo").status == OK


def test_gloo_without_interface_on_a_loopback_host_name_fails_across_hosts() -> None:
    facts = make_facts(world=4, per_node=2, host_resolved="127.0.1.1")
    assert network.check_gloo_interfaces(facts, "gloo", several_hosts=True).status == FAIL
    assert network.check_gloo_interfaces(facts, "gloo", several_hosts=False).status == OK


def test_nccl_interface_rules() -> None:
    interfaces = ["lo", "eth0", "ib0", "ib1", "docker0"]
    assert network.nccl_matches("ib", interfaces) == ["ib0", "ib1"]
    assert network.nccl_matches("=ib0", interfaces) == ["ib0"]
    assert network.nccl_matches("^lo,docker", interfaces) == ["eth0", "ib0", "ib1"]
    facts = make_facts(comm_env={"NCCL_SOCKET_IFNAME": "hsn"})
    row = network.check_nccl_interfaces(facts, "nccl")
    assert row.status == FAIL and row.blocking and "hsn" in row.detail
    assert network.check_nccl_interfaces(replace(facts, comm_env={"NCCL_SOCKET_IFNAME": "eth"}), "nccl").status == OK


def test_master_address_placement() -> None:
    facts = job(4, 2)
    rank0 = replace(facts[0], interfaces={"eth0": {"addresses": ["10.0.0.1"], "state": "up"}})
    assert network.check_master_placement(rank0, facts, [], "rank0").status == OK
    elsewhere = replace(rank0, master_resolved="10.0.0.9")
    assert network.check_master_placement(elsewhere, facts, [], "rank0").status == WARN
    assert network.check_master_placement(elsewhere, facts, [2, 3], "rank0").status == FAIL
    assert network.check_master_placement(elsewhere, facts, [], "agent").status == OK  # torchrun's store
    loopback = replace(rank0, master_addr="127.0.0.1", master_resolved="127.0.0.1")
    assert network.check_master_placement(loopback, facts, [], "rank0").status == FAIL  # node0 and node1
    assert network.check_master_placement(loopback, {0: facts[0], 1: facts[1]}, [2, 3], "rank0").status == FAIL
    one_host = {rank: replace(f, host="node0") for rank, f in facts.items()}
    assert network.check_master_placement(loopback, one_host, [], "rank0").status == OK


def test_master_address_that_does_not_resolve_fails() -> None:
    assert network.check_master_resolves(make_facts()).status == OK
    lost = make_facts(master_addr="head-node", master_resolved=None, master_error="Name or service not known")
    row = network.check_master_resolves(lost)
    assert row.status == FAIL and row.blocking and "head-node" in row.detail


def test_taken_port_fails() -> None:
    row = network.store_row("rank0", "10.0.0.1:29500", "address already in use")
    assert row.status == FAIL and row.blocking


# --- launch arithmetic ------------------------------------------------------------------------


def test_rank_that_never_reported_fails() -> None:
    row = launch_math.check_reported(4, [3], 60, "10.0.0.1:29500")
    assert row.status == FAIL and row.blocking
    assert "rank 3 of 4 did not report within 60 s" in row.detail


def test_rank_claimed_twice_and_world_sizes_that_disagree_fail() -> None:
    facts = job(2)
    assert launch_math.check_claims(facts, 2, {0: 1, 1: 1}).status == OK
    assert "rank 1 by 2" in launch_math.check_claims(facts, 2, {0: 1, 1: 2}).detail
    facts[1] = replace(facts[1], world_size=3)
    assert launch_math.check_claims(facts, 2, {0: 1, 1: 1}).status == FAIL


def test_world_size_must_be_nodes_times_processes_per_node() -> None:
    assert only(launch_math.check_layout(job(4, 2), 4), "launch.world_size").status == OK
    wrong = {rank: replace(f, world_size=3) for rank, f in job(2, 2).items()}  # WORLD_SIZE=3, 1 node x 2
    row = only(launch_math.check_layout(wrong, 3), "launch.world_size")
    assert row.status == FAIL and "world size 3 != 1 node x 2 processes = 2" in row.detail


def test_two_processes_with_one_local_rank_fail() -> None:
    facts = job(2, 2)
    facts[1] = replace(facts[1], local_rank=0)
    assert only(launch_math.check_layout(facts, 2), "launch.nodes").status == FAIL


SLURM_BATCH = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "4"}


def test_slurm_job_of_four_tasks_running_two_processes_fails() -> None:
    rank0 = make_facts(scheduler_env=SLURM_BATCH, launcher="nodescale doctor --nproc")
    alloc = launch_math.allocation(rank0)
    assert alloc == launch_math.Allocation("slurm", 4, 1, False, "SLURM_NTASKS=4, SLURM_NNODES=1, "
                                           "SLURM_NTASKS_PER_NODE=4")
    row = launch_math.check_allocation(alloc, rank0)
    assert row.status == FAIL and "asked for 4 tasks" in row.detail and "--nproc 4" in row.hint
    four = make_facts(world=4, per_node=4, scheduler_env=SLURM_BATCH)
    assert launch_math.check_allocation(alloc, four).status == OK


def test_slurm_batch_script_running_once_outside_srun_fails() -> None:
    single = make_facts(world=1, per_node=1, source="single", scheduler_env=SLURM_BATCH)
    row = launch_math.check_allocation(launch_math.allocation(single), single)
    assert row.status == FAIL and "srun" in row.hint


def test_srun_torchrun_one_launcher_per_node_passes() -> None:
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_NTASKS": "8"}
    rank0 = make_facts(world=8, per_node=4, scheduler_env=step)
    assert launch_math.check_allocation(launch_math.allocation(rank0), rank0).status == OK
    srun = make_facts(world=2, per_node=1, source="slurm", scheduler_env=step)
    assert launch_math.check_allocation(launch_math.allocation(srun), srun).status == OK


def test_pbs_job_compares_node_file_slots() -> None:
    rank0 = make_facts(world=2, per_node=1, scheduler_env={"PBS_JOBID": "1.pbs"}, pbs_nodes=["a", "b"], pbs_slots=2)
    assert launch_math.check_allocation(launch_math.allocation(rank0), rank0).status == OK
    assert launch_math.check_allocation(None, rank0).status == OK


def test_processes_per_node_against_gpus_per_node() -> None:
    def gpus(count: int, seen: int, per_node: int) -> list[Check]:
        facts = {rank: make_facts(rank, per_node, per_node, scheduler_env={"SLURM_GPUS_ON_NODE": str(count)},
                                  gpu_count=seen, device=f"cuda:{rank}" if seen else "cpu")
                 for rank in range(per_node)}
        return launch_math.check_gpus_per_node(facts, "nccl")

    assert [row.status for row in gpus(4, 4, 4)] == [OK]
    assert [row.status for row in gpus(4, 4, 2)] == [WARN]  # two GPUs idle
    assert [row.status for row in gpus(0, 0, 2)] == [OK]  # CPU only
    assert [row.status for row in gpus(1, 0, 1)] == [WARN]  # Slurm gave a GPU, a CPU build of torch
    shared = {rank: make_facts(rank, 2, 2, gpu_count=1, device="cuda:0", device_uuid="GPU-1") for rank in range(2)}
    rows = launch_math.check_gpus_per_node(shared, "nccl")
    assert {row.name for row in rows if row.status == FAIL} == {"launch.gpus_per_node", "launch.gpu_sharing"}


# --- consistency ------------------------------------------------------------------------------


def test_versions_must_match_across_nodes() -> None:
    facts = job(4, 2)
    assert {row.status for row in consistency.check_versions(facts)} == {OK}
    facts[3] = replace(facts[3], torch_version="2.12.1", python_executable="/other/bin/python")
    rows = consistency.check_versions(facts)
    assert only(rows, "versions.torch").status == FAIL
    assert "2.12.1 on rank 3 (node1)" in only(rows, "versions.torch").detail
    assert only(rows, "versions.executable").status == WARN


def test_devices_and_gpu_counts_must_match() -> None:
    facts = job(4, 2)
    assert {row.status for row in consistency.check_devices(facts, "gloo")} == {OK}
    mixed = {rank: replace(f, device="cuda:0", gpu_count=2, backend="nccl", backends_available=["gloo", "nccl"])
             if f.node_rank == 0 else f for rank, f in facts.items()}
    rows = consistency.check_devices(mixed, "nccl")
    assert only(rows, "devices.backend").blocking
    assert only(rows, "devices.gpus_per_node").status == WARN
    assert only(consistency.check_devices(facts, "nccl"), "devices.backend").blocking  # no nccl in the build


def test_ranks_pinned_to_the_same_cpus_warn() -> None:
    facts = {rank: replace(f, cpu_affinity=[0], cpu_count=8) for rank, f in job(2).items()}
    assert consistency.check_affinity(facts).status == WARN
    facts[1] = replace(facts[1], cpu_affinity=[1])
    assert consistency.check_affinity(facts).detail == "each rank pinned to its own CPUs"


# --- bandwidth --------------------------------------------------------------------------------


def test_bandwidth_definitions_follow_nccl_tests() -> None:
    assert bandwidth.algbw_gbps(4_000_000, 0.002) == pytest.approx(2.0)
    assert bandwidth.busbw_gbps(4_000_000, 0.002, 4) == pytest.approx(3.0)  # x 2(n-1)/n = 1.5
    assert bandwidth.busbw_gbps(4_000_000, 0.002, 1) == 0.0


def test_slow_rank_is_below_half_the_median() -> None:
    assert bandwidth.slow_outliers({0: 10.0, 1: 9.0, 2: 11.0, 3: 4.0}) == {3: 4.0}
    assert bandwidth.slow_outliers({0: 10.0, 1: 6.0}) == {}
    assert bandwidth.slow_outliers({0: 10.0}) == {}


def measured(seconds: float, **changes: Any) -> dict[str, Any]:
    return {"error": None, "backend": "gloo", "verified": True, "wrong": 0, "got": 3.0, "expected": 3.0,
            "elements": 1024, "dtype": "float32", "passes": 2, "bytes": 4 * 2**20, "iters": 5, "seconds": seconds,
            **changes}


def test_allreduce_rows_from_measurements() -> None:
    hosts = {0: "node0", 1: "node0", 2: "node1", 3: "node1"}
    rows = bandwidth.check_allreduce({0: measured(0.01), 1: measured(0.01), 2: measured(0.01), 3: measured(0.05)},
                                     4, hosts)
    assert [row.status for row in rows] == [OK, OK, WARN]
    assert "rank 3 (node1)" in rows[2].detail
    wrong = bandwidth.check_allreduce({0: measured(0.01), 1: measured(0.01, verified=False, wrong=5, got=2.0)}, 2,
                                      hosts)
    assert wrong[0].status == FAIL and "5 of 1024 elements wrong" in wrong[0].detail
    failed = bandwidth.check_allreduce({0: measured(0.01, error="all_reduce failed: timeout")}, 2, hosts)
    assert failed[0].status == FAIL


def test_link_partners_are_one_rank_per_other_node() -> None:
    assert bandwidth.partners([0, 0, 1, 1, 2, 2]) == ("node", [2, 4])
    assert bandwidth.partners([0, 0, 0]) == ("rank", [1, 2])
    row = bandwidth.check_links({2: 0.001, 4: 0.001, 6: 0.001, 8: 0.01}, 4 * 2**20, {8: "node4"}, "node")
    assert row.status == WARN and "rank 8 (node4)" in row.detail


def test_blocking_failure_skips_the_collective() -> None:
    facts = job(2, comm_env={"GLOO_SOCKET_IFNAME": "nosuch0"})
    rows = evaluate.before_collective(facts, 2, [], {0: 1, 1: 1}, 60, network.store_row("agent", "x:1"), "agent",
                                      "gloo")
    plan = evaluate.plan(rows, facts, "gloo")
    assert not plan.run and "network.GLOO_SOCKET_IFNAME" in plan.reason
    skipped = evaluate.after_collective(plan, {}, [], facts, 2, 60)
    assert [row.status for row in skipped] == [FAIL]
    healthy = evaluate.before_collective(job(2), 2, [], {0: 1, 1: 1}, 60, network.store_row("agent", "x:1"),
                                         "agent", "gloo")
    assert {row.status for row in healthy} == {OK}
    assert evaluate.plan(healthy, job(2), "gloo") == evaluate.Plan(True, "gloo", "", [1], "rank")


def test_exchange_names_the_ranks_that_did_not_report() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    for rank in (0, 2):
        Exchange(store, rank, 3, "local").publish("facts", {"rank": rank})
    started = time.monotonic()
    found, missing = Exchange(store, 0, 3, "local").gather("facts", timeout_s=0.3)
    assert (sorted(found), missing) == ([0, 2], [1])
    assert time.monotonic() - started < 5
    assert Exchange(store, 1, 3, "local").wait_for("plan", timeout_s=0.2) is None


# --- the command, in real processes -----------------------------------------------------------


def doctor(args: list[str], cwd: Path, extra_env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``nodescale doctor ARGS`` with ``extra_env``; the result whatever its exit code."""
    env = {**cli_env(), **(extra_env or {})}
    return subprocess.run([sys.executable, "-m", "nodescale", "doctor", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def rows_of(out_dir: Path) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in json.loads((out_dir / "doctor.json").read_text())["checks"]}


def assert_clean(result: subprocess.CompletedProcess[str]) -> None:
    """A report, not a crash: no Python traceback and no C++ stack trace anywhere."""
    for text in (result.stdout, result.stderr):
        assert "Traceback" not in text and "frame #" not in text, text


@multiproc
def test_healthy_local_run_is_all_ok(tmp_path: Path) -> None:
    result = run_cli(["doctor", "--nproc", "2", "--out", str(tmp_path / "report"), "--timeout", "60"], cwd=tmp_path)
    document = json.loads((tmp_path / "report" / "doctor.json").read_text())
    assert (document["status"], document["exit_code"], document["world_size"]) == (OK, 0, 2)
    assert {row["status"] for row in document["checks"]} == {OK}, document["checks"]
    assert [rank["rank"] for rank in document["ranks"]] == [0, 1]
    # read from this machine's /sys: one NUMA node, no GPU
    assert [(rank["numa_node_count"], rank["numa_nodes"], rank["gpu_numa_node"]) for rank in document["ranks"]] \
        == [(1, [0], None)] * 2
    assert "one NUMA node per host" in str(document["checks"])
    assert all(rank["allreduce"]["verified"] and rank["allreduce"]["seconds"] > 0 for rank in document["ranks"])
    assert document["collective"] == {"ran": True, "reason": "", "backend": "gloo", "link_partners": [1],
                                      "link_kind": "rank"}
    assert "allreduce.bandwidth" in result.stdout and "exit code 0" in result.stdout
    assert_clean(result)


@multiproc
def test_slurm_request_the_run_does_not_match_fails(tmp_path: Path) -> None:
    # A batch script's variables for 4 tasks on 1 node, but only 2 local processes: detect() still
    # sees torchrun's variables in the workers (no SLURM_PROCID/SLURM_STEP_ID), as in a real batch script.
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "4"}
    result = doctor(["--nproc", "2", "--timeout", "30", "--out", str(tmp_path)], tmp_path, slurm)
    assert result.returncode == 1, result.stderr
    rows = rows_of(tmp_path)
    assert {name for name, row in rows.items() if row["status"] == FAIL} == {"launch.scheduler"}
    assert "world size 2 (1 node x 2), but the Slurm job asked for 4 tasks" in rows["launch.scheduler"]["detail"]
    assert rows["launch.world_size"]["detail"].startswith("2 ranks = 1 node x 2 processes")
    assert rows["allreduce.result"]["status"] == OK  # the 2 ranks themselves work
    assert_clean(result)


@multiproc
def test_misspelt_nccl_variable_fails_with_did_you_mean(tmp_path: Path) -> None:
    result = doctor(["--json", "--timeout", "30"], tmp_path, {"NCCL_SOCKET_IFNAM": "eth0"})
    assert result.returncode == 1, result.stderr
    document = json.loads(result.stdout)  # --json: stdout is the document and nothing else
    rows = {row["name"]: row for row in document["checks"]}
    row = rows["env.NCCL_SOCKET_IFNAM"]
    assert (row["status"], row["hint"]) == (FAIL, "did you mean NCCL_SOCKET_IFNAME?")
    assert document["ranks"][0]["comm_env"]["NCCL_SOCKET_IFNAM"] == "eth0"
    assert_clean(result)



def by_hand(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables srun/mpiexec job scripts export per task (nodescale launch --mode per-gpu)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def start_by_hand(world: int, args: list[str], cwd: Path, extra_env: dict[str, str] | None = None,
                  ranks: tuple[int, ...] | None = None) -> list[subprocess.Popen[str]]:
    """``nodescale doctor ARGS`` as ``ranks`` of ``world``, each a process started with per-task variables."""
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "nodescale", "doctor", *args], cwd=cwd,
                             env={**cli_env(), **by_hand(rank, world, port), **(extra_env or {})},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in (ranks if ranks is not None else range(world))]


@multiproc
def test_missing_interface_and_missing_rank_are_fail_rows_not_a_hang(tmp_path: Path) -> None:
    """Ranks 0 and 1 of 3 started by hand (rank 2 never comes), with GLOO_SOCKET_IFNAME=nosuch0."""
    started = time.monotonic()
    # 8 s: rank 1 must make it in time even on a loaded machine (it imports torch as rank 0 does, and
    # torch's store client retries a refused connection with a back-off of a second or two).
    procs = start_by_hand(3, ["--timeout", "8", "--out", str(tmp_path)], tmp_path, {"GLOO_SOCKET_IFNAME": "nosuch0"},
                          ranks=(0, 1))
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert time.monotonic() - started < 60  # one --timeout for rank 2, then rank 0 decides for everyone
    assert [proc.returncode for proc in procs] == [1, 0], outputs  # rank 0 carries the verdict
    rows = rows_of(tmp_path)
    row = rows["network.GLOO_SOCKET_IFNAME"]
    assert row["status"] == FAIL and "GLOO_SOCKET_IFNAME=nosuch0: no interface 'nosuch0' on host" in row["detail"]
    assert row["detail"].startswith("ranks 0-1: ")
    assert rows["launch.ranks_reported"]["detail"] == "rank 2 of 3 did not report within 8 s"
    assert rows["network.master_port"]["status"] == OK  # rank 0 hosted the store itself
    assert rows["allreduce.result"]["status"] == FAIL and "not run" in rows["allreduce.result"]["detail"]
    assert "nosuch0" in outputs[0][0]
    assert outputs[1] == ("", "")  # the other ranks print nothing
    for stdout, stderr in outputs:
        assert_clean(subprocess.CompletedProcess([], 0, stdout, stderr))


@multiproc
def test_ranks_started_by_hand_meet_at_rank_zeros_store(tmp_path: Path) -> None:
    """The srun/mpiexec path: rank 0 hosts the store; the process group later shares its port."""
    procs = start_by_hand(2, ["--timeout", "60", "--json"], tmp_path)
    outputs = [proc.communicate(timeout=150) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    document = json.loads(outputs[0][0])
    assert document["status"] == OK, [row for row in document["checks"] if row["status"] != OK]
    port = document["ranks"][0]["master_port"]
    assert {row["name"]: row["detail"] for row in document["checks"]}["network.master_port"] == (
        f"127.0.0.1:{port}: free, rank 0 listens there")
    assert outputs[1] == ("", "")  # the other ranks print nothing


def test_nproc_must_be_a_positive_whole_number(tmp_path: Path) -> None:
    result = run_cli(["doctor", "--nproc", "0"], cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert "nodescale: error: --nproc 0: must be a whole number, at least 1" in result.stderr
    assert "Traceback" not in result.stderr
    for bad in ("-2", "two", "1.5"):
        with pytest.raises(UserError, match=f"--nproc {bad}: must be a whole number"):
            parse_nproc(bad)
    assert (parse_nproc("3"), parse_nproc(None)) == (3, None)
    with pytest.raises(UserError, match="--timeout 0"):
        parse_timeout("0")



# --- NUMA locality (a fake sysfs tree: this machine has one NUMA node and no GPU) ----------------


def fake_sysfs(root: Path, node_cpus: dict[int, str], gpus: dict[str, str]) -> Path:
    for node, cpulist in node_cpus.items():
        (root / f"devices/system/node/node{node}").mkdir(parents=True)
        (root / f"devices/system/node/node{node}/cpulist").write_text(cpulist + "\n")
    for address, numa_node in gpus.items():
        (root / f"bus/pci/devices/{address}").mkdir(parents=True)
        (root / f"bus/pci/devices/{address}/numa_node").write_text(numa_node + "\n")
    return root


def test_numa_nodes_of_cpus_and_gpus_from_sysfs(tmp_path: Path) -> None:
    from nodescale.distributed import numa_nodes as numa

    sys_root = fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"}, {"0000:3b:00.0": "0", "0000:dc:00.0": "-1"})
    nodes = numa.node_cpus(sys_root)
    assert nodes == {0: {0, 1, 2, 3, 8, 9, 10, 11}, 1: {4, 5, 6, 7, 12, 13, 14, 15}}
    assert numa.nodes_of_cpus([4, 5], nodes) == [1] and numa.nodes_of_cpus(range(16), nodes) == [0, 1]
    assert numa.gpu_node(numa.pci_address(0, 0x3B, 0), sys_root) == 0
    assert numa.gpu_node("0000:dc:00.0", sys_root) is None  # -1: the kernel does not know
    assert numa.gpu_node("0000:01:00.0", sys_root) is None  # no such device
    assert numa.parse_cpulist("0-1,x") == set() and numa.parse_cpulist("") == set()


def test_torchrun_worker_binds_near_its_gpu_where_nothing_bound_it(tmp_path: Path) -> None:
    from nodescale.distributed import cpu_binding, numa_nodes

    nodes = numa_nodes.node_cpus(fake_sysfs(tmp_path / "two", {0: "0-3,8-11", 1: "4-7,12-15"}, {}))
    every = set(range(16))

    def chose(allowed: set[int], gpu: int | None, rule: str = "", local_rank: int = 1) -> set[int] | None:
        choice = cpu_binding.choose(local_rank, allowed, nodes, gpu, rule)
        assert choice.warn is False, choice.why
        return None if choice.cpus is None else set(choice.cpus)

    assert chose(every, 1) == nodes[1]
    assert chose(set(range(6)), 1) == {4, 5}  # only what the scheduler allows
    assert chose({0, 1, 2}, 1) is None  # bound within one node already (srun --cpu-bind, torchrun): left alone
    assert chose(every, None) is None and chose(every, 1, "none") is None
    assert chose(every, 0, "", 0) == nodes[0]
    assert chose(every, None, "mask_cpu:0x3,0x30") == {4, 5}  # the preset's rule: entry LOCAL_RANK
    assert chose(every, None, "mask_cpu:0x3,0x30", 2) == {0, 1}  # reused from the start, as Slurm does
    assert chose(every, 0, "map_ldom:1,0", 0) == nodes[1] and chose(every, 0, "list:0-1:8-9") == {8, 9}
    one_node = numa_nodes.node_cpus(fake_sysfs(tmp_path / "one", {0: "0-15"}, {}))
    assert cpu_binding.choose(0, every, one_node, 0).cpus is None
    for rule, allowed in (("mask_cpu:zz", every), ("mask_cpu:0xc000", {0, 1, 4, 5})):
        assert cpu_binding.choose(0, allowed, nodes, 0, rule).warn  # unreadable rule; no allowed CPU in it

    # The real call, on this process: bound, then left alone once bound; other launchers untouched.
    first, *rest = sorted(os.sched_getaffinity(0))
    if not rest:
        pytest.skip("one CPU: nothing to bind")
    sys_root = fake_sysfs(tmp_path / "here", {0: str(first), 1: ",".join(map(str, rest))}, {})
    before = os.sched_getaffinity(0)
    cpu_binding._warned.clear()
    with pytest.warns(UserWarning, match="CPU binding: .*not a per-task list.*NODESCALE_CPU_BIND=none") as told:
        for _ in range(2):  # one warning a process, never an error
            bad_rule = {"NODESCALE_CPU_BIND": "map_cpu:x"}
            assert cpu_binding.bind_near_gpu("torchrun", 0, "cpu", bad_rule, sys_root) is None
    assert len(told) == 1
    try:
        assert cpu_binding.bind_near_gpu("slurm", 0, "cpu", {"NODESCALE_CPU_BIND": "map_ldom:1"}, sys_root) is None
        assert cpu_binding.bind_near_gpu("torchrun", 0, "cpu", {"NODESCALE_CPU_BIND": "map_ldom:1"},
                                         sys_root) == set(rest) == os.sched_getaffinity(0)
        assert cpu_binding.bind_near_gpu("torchrun", 0, "cpu", {"NODESCALE_CPU_BIND": "map_ldom:0"},
                                         sys_root) is None  # within one NUMA node now
    finally:
        cpu_binding.set_affinity(before)


def test_rank_whose_cpus_are_not_on_its_gpus_numa_node_warns() -> None:
    from nodescale.doctor import numa

    facts = job(2, numa_node_count=2, numa_nodes=[0])
    facts[0] = replace(facts[0], gpu_numa_node=0)
    facts[1] = replace(facts[1], gpu_numa_node=1)
    row = numa.check_locality(facts)
    assert row.status == WARN and "rank 1 on node0: CPUs on NUMA node 0, its GPU on node 1" in row.detail
    assert "rank 0" not in row.detail
    facts[1] = replace(facts[1], numa_nodes=[0, 1])  # unbound: may run on either node
    assert numa.check_locality(facts).detail == "rank 1 may run on NUMA nodes 0-1, not only their GPU's"
    facts[1] = replace(facts[1], numa_nodes=[1])
    assert numa.check_locality(facts) == Check("cpu.numa", OK, "ranks 0-1: CPUs on their GPU's NUMA node")
    assert numa.check_locality(job(2, numa_node_count=1, numa_nodes=[0])).detail.startswith("one NUMA node")
    assert "no GPU on a known NUMA node" in numa.check_locality(job(2, numa_node_count=2, numa_nodes=[0])).detail
