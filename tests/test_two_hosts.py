"""A PBS job whose rendezvous really crosses a network link: two "hosts" as network namespaces.

Two network namespaces joined by a veth pair stand for two compute nodes: each has only its
loopback and its end of the link, so the second node reaches the first one's c10d store and
gloo sockets over the veth or not at all. The job script is the one ``nodescale launch
--dry-run`` prints for generic-pbs (MPICH's Hydra ``mpiexec``), run as PBS Pro runs it: the
``PBS_*`` variables, a node file listing the two namespace addresses, and the batch script
itself running in the first namespace, as PBS runs it on the head node.

Hydra starts a ``hydra_pmi_proxy`` per node. For the head node (the batch script's own
namespace, where its address is local) it forks the proxy itself; for the other node it calls
its launcher, here a stand-in for ssh / PBS's TM interface named by ``HYDRA_LAUNCHER_EXEC``:
it maps the target host's address to that node's namespace and runs the proxy command there
with ``nsenter --net=/run/netns/NAME``, in the job's initial environment. The proxy connects
back to mpiexec's control port on the head's veth address (Hydra takes the node file's name of
the local host for it), and Hydra passes mpiexec's environment on to the processes it starts.

A ``torchrun`` wrapper first on the job's PATH records, for each node, its argv and the
network namespace it runs in, then execs the real torchrun: that is how the test sees which
``--local-addr`` and ``is_host`` each node computed.

Needs root, iproute2 (``ip netns``), ``nsenter`` and MPICH: missing ones skip the test, or fail
it where CI is set. The namespaces get unique names per run and are deleted at the end, also
when the test failed.
"""

from __future__ import annotations

import ipaddress
import os
import random
import re
import shlex
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import read_summary, run_cli
from nodescale.distributed.env import port_for_job
from scheduler_fixtures import MPIEXEC, _pbs_environment, require, run_job_script, search_path

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

# Both ends of the link carry this name, each in its own namespace, so that one
# GLOO_SOCKET_IFNAME (a --env of the job, the same on every node) fits both nodes.
VETH = "nsveth"

STEPS = 4
JOB_TIMEOUT = 60


def unavailable(reason: str) -> None:
    """Skip, or fail where CI is set: CI must never pass by skipping this test."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: this is a failure here, not a skip)", pytrace=False)
    pytest.skip(reason)


def ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)} exited {result.returncode}: {result.stderr.strip()}")
    return result


def free_subnet() -> ipaddress.IPv4Network:
    """A 10.200.x.0/24 that no address or route of this machine's own namespace overlaps.

    The namespaces are isolated from it and from each other, so only this one is checked: the
    recipe's n0/n1 (10.200.0.0/24), if someone runs them now, do not collide with ours.
    """
    used = []
    for line in ip("-o", "-4", "addr").stdout.splitlines():
        found = re.search(r"\binet (\S+)", line)
        if found:
            used.append(ipaddress.ip_interface(found.group(1)).network)
    for line in ip("-4", "route").stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word and word != "default":
            try:
                used.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                pass
    for third in range(256):
        candidate = ipaddress.ip_network(f"10.200.{third}.0/24")
        if not any(candidate.overlaps(network) for network in used):
            return candidate
    unavailable(f"no free 10.200.x.0/24 on this machine; in use: {used}")
    raise AssertionError("unreachable")


@dataclass
class Host:
    """One "node": a network namespace and its address on the link."""

    namespace: str
    address: str

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.namespace}"

    def inode(self) -> int:
        """The namespace's identity, as /proc/PID/ns/net of a process inside it shows it."""
        return os.stat(self.netns_path).st_ino


@pytest.fixture
def two_hosts() -> Iterator[list[Host]]:
    """Two network namespaces joined by a veth pair, each end named ``nsveth``; deleted at the end."""
    require(["ip", "nsenter"], "the two-host test")
    if os.geteuid() != 0:
        unavailable("the two-host test creates network namespaces and needs root")
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:4]}"
    hosts: list[Host] = []
    created: list[str] = []
    try:
        try:
            subnet = free_subnet()
            hosts = [Host(f"ns-{tag}-{i}", str(subnet.network_address + 1 + i)) for i in range(2)]
            for host in hosts:
                ip("netns", "add", host.namespace)
                created.append(host.namespace)
            # Created in place, each end straight into its namespace: no name clash in this one.
            ip("link", "add", VETH, "netns", hosts[0].namespace, "type", "veth",
               "peer", "name", VETH, "netns", hosts[1].namespace)
            for host in hosts:
                ip("-n", host.namespace, "addr", "add", f"{host.address}/{subnet.prefixlen}", "dev", VETH)
                ip("-n", host.namespace, "link", "set", "lo", "up")
                ip("-n", host.namespace, "link", "set", VETH, "up")
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            unavailable(f"cannot create two network namespaces joined by a veth pair here: {exc}")
        yield hosts
    finally:
        left = []
        for name in created:
            # Deleting a namespace removes its veth end, and with it the peer.
            if ip("netns", "del", name, check=False).returncode != 0:
                left.append(name)
        assert not left, f"network namespaces not deleted: {left}"


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job registry and an empty user preset folder of this test's own."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("NODESCALE_PRESET_DIR", str(tmp_path / "presets"))
    monkeypatch.setenv("PATH", search_path())


# A stand-in for ssh / PBS's TM interface: Hydra calls it as `AGENT [options] HOST COMMAND`.
# It runs COMMAND on HOST, that is in HOST's namespace, in the job's initial environment.
_AGENT = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1
shift
case "$host" in
{cases}
    *) echo "pbs-tm-agent: unknown host $host" >&2; exit 1 ;;
esac
echo "$host $namespace" >> {log}
exec nsenter --net=/run/netns/"$namespace" env -i {env} /bin/sh -c "$*"
"""

# Records argv and network namespace of every torchrun the job starts, one file per call.
_TORCHRUN = """#!/bin/sh
{{
    stat -L -c %i /proc/self/ns/net
    for word in "$@"; do printf '%s\\n' "$word"; done
}} > {log_dir}/torchrun.$$
exec {real} "$@"
"""


@dataclass
class Job:
    returncode: int
    output: str
    job_id: str
    # "HOST NAMESPACE" per proxy the launcher stand-in started.
    launched: list[str]
    # namespace inode -> argv of the torchrun that ran in it.
    torchruns: dict[int, list[str]]


def run_in_namespaces(script: Path, hosts: list[Host], scratch: Path, workdir: Path) -> Job:
    """Run ``script`` as PBS Pro would on ``hosts``: batch script on the first, Hydra proxies on each."""
    binaries = require([MPIEXEC["mpich"], "torchrun"], "the two-host PBS job")
    job_id = f"{random.randrange(100_000, 1_000_000)}.pbsserver"
    bin_dir, log_dir = scratch / "bin", scratch / "log"
    for folder in (bin_dir, log_dir, scratch / "home"):
        folder.mkdir(parents=True)
    nodefile = scratch / "nodefile"
    nodefile.write_text("".join(f"{host.address}\n" for host in hosts))
    env = _pbs_environment(scratch, bin_dir, nodefile, job_id, "nodescale", workdir)

    cases = "\n".join(f"    {host.address}) namespace={host.namespace} ;;" for host in hosts)
    agent = bin_dir / "pbs-tm-agent"
    agent.write_text(_AGENT.format(cases=cases, log=shlex.quote(str(log_dir / "launched")),
                                   env=" ".join(shlex.quote(f"{k}={v}") for k, v in env.items())))
    # A wrapper, not a link: Hydra looks for hydra_pmi_proxy beside the mpiexec it was started as.
    mpiexec = bin_dir / "mpiexec"
    mpiexec.write_text(f'#!/bin/sh\nexec {shlex.quote(binaries[MPIEXEC["mpich"]])} "$@"\n')
    torchrun = bin_dir / "torchrun"
    torchrun.write_text(_TORCHRUN.format(log_dir=shlex.quote(str(log_dir)), real=shlex.quote(binaries["torchrun"])))
    for program in (agent, mpiexec, torchrun):
        program.chmod(0o755)
    env.update({"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(agent)})

    # The batch script runs in the first host's namespace, as PBS runs it on the head node.
    returncode, output = run_job_script(["nsenter", f"--net={hosts[0].netns_path}", "/bin/bash", str(script)],
                                        scratch / "home", env, job_id, JOB_TIMEOUT, "the two-host PBS job")

    launched_log = log_dir / "launched"
    launched = launched_log.read_text().splitlines() if launched_log.exists() else []
    torchruns = {}
    for record in sorted(log_dir.glob("torchrun.*")):
        inode, *argv = record.read_text().splitlines()
        torchruns[int(inode)] = argv
    return Job(returncode, output, job_id, launched, torchruns)


def dry_run_script(cwd: Path) -> Path:
    """The script `nodescale launch --dry-run` prints, written where it says qsub would read it."""
    result = run_cli(["launch", "--scheduler", "pbs", "--cluster", "generic-pbs", "--nodes", "2",
                      "--gpus-per-node", "0", "--nproc-per-node", "1", "--env", f"GLOO_SOCKET_IFNAME={VETH}",
                      "--dry-run", "--", "nodescale", "train", "--max-steps", str(STEPS), "--no-progress",
                      "--out", "RUN"], cwd=cwd)
    submit, _, text = result.stdout.partition("\n")
    assert submit.startswith("# qsub "), result.stdout
    assert text.startswith("#!/bin/bash\n"), result.stdout
    path = Path(submit.removeprefix("# qsub "))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def option(argv: list[str], name: str) -> str | None:
    """The value of ``--name=VALUE`` in ``argv``."""
    return next((word.split("=", 1)[1] for word in argv if word.startswith(f"--{name}=")), None)


def test_pbs_job_rendezvous_crosses_a_network_link(two_hosts: list[Host], tmp_path: Path) -> None:
    head, other = two_hosts
    script = dry_run_script(tmp_path)
    job = run_in_namespaces(script, two_hosts, tmp_path / "pbs", workdir=tmp_path)
    details = f"\n--- job output\n{job.output}\n--- launched: {job.launched}\n--- torchruns: {job.torchruns}"

    assert job.returncode == 0, details
    port = port_for_job(job.job_id)
    assert f"nodescale: rendezvous at {head.address}:{port}" in job.output, details
    # The second node's proxy went through the launcher, into its own namespace.
    assert f"{other.address} {other.namespace}" in job.launched, details

    # One torchrun in each namespace, each told its own address on the link.
    assert sorted(job.torchruns) == sorted([head.inode(), other.inode()]), details
    for host, is_host in ((head, "1"), (other, "0")):
        argv = job.torchruns[host.inode()]
        assert option(argv, "local-addr") == host.address, (host, argv)
        assert option(argv, "rdzv-conf") == f"is_host={is_host}", (host, argv)
        assert option(argv, "rdzv-endpoint") == f"{head.address}:{port}", (host, argv)
        assert option(argv, "rdzv-id") == job.job_id, (host, argv)

    summary = read_summary(tmp_path / "RUN")
    assert summary["world_size"] == 2, summary
    assert summary["global_steps"] == STEPS, summary

