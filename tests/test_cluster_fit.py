"""A job checked against the nodes the scheduler reports, without a scheduler: scontrol's and PBS's
output parsed from recorded text, the fit and its refusals, the allocation rule, and the NodeAddr
fallback of rank discovery. The same paths against the real local Slurm: test_slurm_live.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodescale.distributed.env import detect
from nodescale.errors import UserError
from nodescale.launch.job_options import SchedulerOptions
from nodescale.launch.partition_fit import Node, Partition, clock_seconds, fit_job
from nodescale.launch.presets import load_preset
from nodescale.launch.render_slurm import render_slurm
from nodescale.launch.schedulers.allocation import cpus_per_node, pbs_allocation, slurm_allocation
from nodescale.launch.schedulers.pbs_nodes import parse_nodes, parse_queue, size_mb
from nodescale.launch.schedulers.slurm_nodes import gres_gpus, parse_partition, records
from nodescale.launch.spec import JobSpec

# `scontrol show partition -o debug` and `scontrol show node -o node[1-2]` of Slurm 22.05 (shortened).
PARTITION = ("PartitionName=debug AllowGroups=ALL Default=YES DefaultTime=NONE MaxNodes=UNLIMITED "
             "MaxTime=UNLIMITED MinNodes=0 Nodes=node[1-2] State=UP TotalCPUs=4 TotalNodes=2")
NODES = "\n".join(
    f"NodeName=node{i} Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.76 "
    f"AvailableFeatures=(null) Gres=(null) NodeAddr=127.0.0.1 NodeHostName=vm Port=4066{i} RealMemory=2000 "
    "AllocMem=0 State=IDLE ThreadsPerCore=1 Partitions=debug  CfgTRES=cpu=2,mem=2000M,billing=2 AllocTRES= "
    for i in (1, 2))

# `pbsnodes -a -F json` and `qstat -Q -f -F json` as PBS Pro 2022 prints them (Polaris-like, shortened).
PBSNODES = json.dumps({"timestamp": 1699630815, "pbs_version": "2022.1.1", "pbs_server": "pbs01", "nodes": {
    **{f"x3006c0s{i}b0n0": {"Mom": f"x3006c0s{i}b0n0.hsn", "ntype": "PBS", "state": "free", "pcpus": 64,
                            "resources_available": {"arch": "linux", "host": f"x3006c0s{i}b0n0", "mem": "527672488kb",
                                                    "ncpus": 64, "ngpus": 4, "vnode": f"x3006c0s{i}b0n0"},
                            "resources_assigned": {}, "sharing": "force_exclhost"} for i in range(3)},
    "login-bound": {"Mom": "login-bound", "state": "free", "queue": "interactive",
                    "resources_available": {"ncpus": 8, "mem": "16gb"}},
}})
QSTAT_Q = json.dumps({"timestamp": 1699637534, "pbs_server": "pbs01", "Queue": {
    "debug": {"queue_type": "Execution", "resources_max": {"nodect": 2, "walltime": "01:00:00"},
              "resources_min": {"nodect": 1, "walltime": "00:05:00"}, "enabled": "True", "started": "True"}}})


def spec_for(preset: str, **changes) -> JobSpec:
    fields = {"scheduler": "slurm", "preset": preset, "nodes": 2, "gpus_per_node": 0, "nproc_per_node": 1,
              "command": ["nodescale", "train"], "workdir": Path("/home/u/p"), "job_dir": Path("/home/u/p/jobs")}
    return JobSpec(**{**fields, **changes})


def two_cpu_partition(**changes) -> Partition:
    nodes = tuple(Node(f"node{i}", 2, 0, 2000) for i in (1, 2, 3))
    return Partition(**{"name": "debug", "nodes": nodes, **changes})


def test_scontrol_records_are_parsed() -> None:
    partition = parse_partition(records(PARTITION)[0], NODES)
    assert partition.name == "debug" and partition.max_time is None and partition.max_nodes is None
    assert partition.nodes == (Node("node1", 2, 0, 2000), Node("node2", 2, 0, 2000))
    limited = parse_partition({**records(PARTITION)[0], "MaxTime": "2-00:00:00", "MaxNodes": "16"}, NODES)
    assert (limited.max_time, limited.max_time_s, limited.max_nodes) == ("2-00:00:00", 2 * 86400, 16)
    assert gres_gpus("gpu:4") == 4 and gres_gpus("gpu:a100:4(S:0-1)") == 4 and gres_gpus("(null)") == 0
    assert gres_gpus("gpu:a100:2,gpu:v100:2,nvme:1") == 4 and gres_gpus("gpu:a100:2,gpu:v100:3", "v100") == 3
    assert [clock_seconds(text) for text in ("30", "05:00", "1-02:00:00", "UNLIMITED")] == [1800, 300, 93600, None]
    assert [SchedulerOptions(mem=text).mem_mb for text in ("16G", "500M", "2000", "0", None)] == [
        16384, 500, 2000, 0, None]


def test_pbs_json_is_parsed() -> None:
    nodes = parse_nodes(PBSNODES, "debug")
    assert len(nodes) == 3  # the node bound to queue "interactive" serves that queue only
    assert nodes[0] == Node("x3006c0s0b0n0", 64, 4, 527672488 // 1024)
    assert len(parse_nodes(PBSNODES, "interactive")) == 4 and len(parse_nodes(PBSNODES, None)) == 4
    queue = parse_queue(QSTAT_Q, "debug", nodes)
    assert (queue.kind, queue.max_time, queue.max_time_s, queue.max_nodes) == ("queue", "01:00:00", 3600, 2)
    assert parse_queue(QSTAT_Q, "other", nodes).max_time is None
    assert size_mb("256gb") == 262144 and size_mb("1024") == 0 and size_mb("x") is None
    assert parse_nodes("not json", None) == ()

    preset = load_preset("generic-pbs")
    with pytest.raises(UserError) as refused:
        fit_job(spec_for("generic-pbs", scheduler="pbs", nodes=3, gpus_per_node=4), preset, queue)
    assert "queue debug allows at most 2 nodes" in str(refused.value) and "--nodes 2" in str(refused.value)


def test_a_generic_preset_is_sized_from_the_nodes() -> None:
    generic = load_preset("generic-slurm")
    spec = spec_for("generic-slurm")
    sized = fit_job(spec, generic, two_cpu_partition())
    assert (sized.cpus_per_node, sized.gpus_per_node) == (2, 0)
    assert "#SBATCH --cpus-per-task=2\n" in render_slurm(spec, sized)  # not the preset's 16
    # A preset that names its cluster keeps its values, and is refused where the nodes are smaller.
    puhti = load_preset("puhti")
    with pytest.raises(UserError) as refused:
        fit_job(spec_for("puhti", account="p"), puhti, two_cpu_partition())
    assert "0 of partition debug's nodes (3) have 40 CPUs" in str(refused.value)


@pytest.mark.parametrize(("changes", "partition", "what", "rule", "hint"), [
    ({"nodes": 4}, {}, "--nodes 4", "partition debug has 3 nodes", "--nodes 3 or fewer"),
    ({"nodes": 3}, {"max_nodes": 2}, "--nodes 3", "allows at most 2 nodes per job", "--nodes 2 or fewer"),
    ({"gpus_per_node": 1}, {}, "--gpus-per-node 1", "0 of partition debug's nodes (3) have 1 GPUs",
     "--gpus-per-node 0"),
    ({"gpus_per_node": 2}, {"nodes": (Node("g1", 8, 4, None), Node("g2", 8, 1, None))}, "--gpus-per-node 2",
     "1 of partition debug's nodes (2) have 2 GPUs", "--gpus-per-node 1"),
    ({"mode": "per-gpu", "nproc_per_node": 3, "gpus_per_node": 3},
     {"nodes": (Node("g1", 2, 4, None), Node("g2", 2, 4, None))}, "--nproc-per-node 3 --mode per-gpu",
     "0 of partition debug's nodes (2) have 1 CPUs per task", "--nproc-per-node 2 or less"),
    ({"time": "00:10:00"}, {"max_time": "00:05:00", "max_time_s": 300}, "--time 00:10:00",
     "partition debug allows at most 00:05:00", "--time 00:05:00 or less"),
    ({"options": SchedulerOptions(cpus_per_task=16)}, {}, "--cpus-per-task 16",
     "0 of partition debug's nodes (3) have 16 CPUs", "--cpus-per-task 2"),
])
def test_requests_no_node_can_meet_name_the_limit_and_what_fits(changes, partition, what, rule, hint) -> None:
    with pytest.raises(UserError) as refused:
        fit_job(spec_for("generic-slurm", **changes), load_preset("generic-slurm"), two_cpu_partition(**partition))
    error = refused.value
    assert error.what.startswith(what) and rule in error.rule and hint in (error.hint or ""), str(error)


def test_memory_above_every_node_is_refused() -> None:
    spec = spec_for("generic-slurm", options=SchedulerOptions(mem="4G"))
    with pytest.raises(UserError) as refused:
        fit_job(spec, load_preset("generic-slurm"), two_cpu_partition())
    assert "MB of memory" in refused.value.rule and "--mem 2000M" in (refused.value.hint or "")


SALLOC = {"SLURM_JOB_ID": "12374", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_CPUS_PER_NODE": "2(x2)"}
BATCH = {**SALLOC, "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURMD_NODENAME": "node1"}


def test_the_allocation_rule() -> None:
    assert slurm_allocation(SALLOC, "0") and not slurm_allocation(BATCH, "1")
    assert slurm_allocation(SALLOC, None) and not slurm_allocation(BATCH, None)  # scontrol silent: the variables
    assert slurm_allocation({**BATCH, "SLURM_STEP_ID": "4294967290"}, "0")  # salloc's interactive step
    assert not slurm_allocation({**BATCH, "SLURM_STEP_ID": "0"}, "0")  # a task of an srun step
    assert not slurm_allocation({}, None)
    assert pbs_allocation({"PBS_ENVIRONMENT": "PBS_INTERACTIVE", "PBS_JOBID": "1.s"})
    assert not pbs_allocation({"PBS_ENVIRONMENT": "PBS_BATCH", "PBS_JOBID": "1.s"})
    assert cpus_per_node("2(x3),1") == [2, 2, 2, 1] and cpus_per_node("") == []


SRUN_RANK_1 = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
               "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_STEP_ID": "0",
               "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "node[1-2]"}


def test_an_unresolvable_head_node_is_found_by_its_node_addr() -> None:
    def resolve(host: str) -> str:
        if host != "10.1.0.9":
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        return host

    asked: list[str] = []
    env = detect(SRUN_RANK_1, resolve=resolve, node_addr=lambda node: asked.append(node) or "10.1.0.9")
    assert env.master_addr == "10.1.0.9" and asked == ["node1"]
    with pytest.raises(UserError, match="nor does its Slurm NodeAddr 'node1-ib'"):
        detect(SRUN_RANK_1, resolve=resolve, node_addr=lambda node: "node1-ib")
    with pytest.raises(UserError, match="does not resolve to an address"):
        detect(SRUN_RANK_1, resolve=resolve, node_addr=lambda node: None)


def test_without_a_reachable_scheduler_the_preset_is_kept_with_one_line_saying_so(monkeypatch) -> None:
    from nodescale.launch.schedulers.table import BATCH

    monkeypatch.setenv("PATH", "/nonexistent")  # no pbsnodes, no scontrol: off the cluster
    for name in ("pbs", "slurm"):
        preset = load_preset(f"generic-{name}")
        with pytest.warns(UserWarning, match=f"{name}'s nodes not read .*is not on PATH.*16 cores and 4 GPUs"):
            dryrun = BATCH[name].dryrun(spec_for(preset.name, scheduler=name, gpus_per_node=4, nproc_per_node=4),
                                        preset)
        assert "16" in (dryrun.script or "")
