"""Real schedulers for the launch tests: a Slurm cluster on this machine, and PBS job scripts run
the way PBS Pro runs them.

``slurm_cluster`` (session-scoped) starts ``scripts/slurm-local.sh``'s cluster (munge,
slurmctld, three slurmd "nodes" with one fake GPU each) in a temporary folder and takes it down
at the end, also when a test failed. ``pbs_run`` executes a rendered PBS script as PBS Pro
would: a node file, the ``PBS_*`` variables, the home directory as working directory, and the
real MPICH or Open MPI ``mpiexec`` starting one daemon per node.

A missing program (slurmctld, sbatch, munged, mpiexec.mpich, ...) skips the tests that need
it, with the reason; where the ``CI`` variable is set it fails them instead, so that CI never
passes by skipping. ``bash scripts/test-setup.sh`` installs them.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from required import unavailable

REPO = Path(__file__).resolve().parents[1]
SLURM_LOCAL = REPO / "scripts" / "slurm-local.sh"

# What the Slurm tests start or call. The daemons live in /usr/sbin, not on every PATH.
SLURM_COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")
SBIN = ("/usr/sbin", "/sbin")
MPIEXEC = {"mpich": "mpiexec.mpich", "openmpi": "mpiexec.openmpi"}

# Slurm job states after which nothing of the job runs any more.
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE"}


def search_path() -> str:
    """PATH with this interpreter's scripts first (the ``nodescale`` and ``torchrun`` of the
    Python running the tests, also when its environment is not activated), then the caller's
    PATH, then the sbin folders."""
    parts = [str(Path(sys.executable).parent), *os.environ.get("PATH", "").split(os.pathsep), *SBIN]
    return os.pathsep.join(dict.fromkeys(part for part in parts if part))


def require(commands: Sequence[str], what: str) -> dict[str, str]:
    """The full path of each command; skip (or fail where CI is set) when one is missing."""
    found = {name: shutil.which(name, path=search_path()) for name in commands}
    missing = [name for name, where in found.items() if where is None]
    if missing:
        unavailable(f"{what} needs {', '.join(missing)}: `bash scripts/test-setup.sh` installs them")
    return {name: str(where) for name, where in found.items()}


def processes_with(text: str) -> dict[int, str]:
    """pid -> command line of every process whose command line contains ``text`` (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        line = " ".join(part.decode(errors="replace") for part in argv if part)
        if text in line:
            found[int(entry.name)] = line
    return found


# --- Slurm ----------------------------------------------------------------------------------------


@dataclass
class SlurmCluster:
    """A running cluster: its folder, ``slurm.conf``, and the environment its commands need."""

    base: Path
    conf: Path
    nodes: int
    cpus_per_node: int
    gpus_per_node: int
    env: dict[str, str] = field(default_factory=dict)

    def command(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (squeue, scontrol, ...) against this cluster."""
        result = subprocess.run(list(argv), env={**os.environ, **self.env}, capture_output=True, text=True,
                                timeout=timeout)
        if check and result.returncode != 0:
            pytest.fail(f"{' '.join(argv)} exited {result.returncode}: {result.stderr.strip()}", pytrace=False)
        return result

    def job_fields(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s KEY=VALUE fields; empty once Slurm forgot the job (MinJobAge)."""
        result = self.command("scontrol", "show", "job", "-o", job_id, check=False)
        if result.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", result.stdout))

    def job_state(self, job_id: str) -> str | None:
        return self.job_fields(job_id).get("JobState")

    def wait_for_state(self, job_id: str, states: set[str], timeout: float) -> str:
        """Poll until the job reaches one of ``states`` (or finishes); fail with its logs after ``timeout``."""
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states or state in FINISHED or state is None:
                return state or "GONE"
            time.sleep(0.5)
        self.command("scancel", job_id, check=False)
        pytest.fail(f"Slurm job {job_id} still {state} after {timeout:.0f} s (cancelled)\n{self.log_tail()}",
                    pytrace=False)

    def wait_until_done(self, job_id: str, timeout: float = 180) -> str:
        return self.wait_for_state(job_id, set(), timeout)

    def log_tail(self, lines: int = 15) -> str:
        text = []
        for log in sorted((self.base / "log").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            text.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(text)


def ci_presets(cwd: Path, cluster: SlurmCluster) -> Path:
    """A preset folder holding ``ci-slurm``: generic-slurm with the test cluster's cores per node."""
    presets = cwd / "presets"
    presets.mkdir()
    (presets / "ci-slurm.yaml").write_text(f"extends: generic-slurm\ndescription: the test cluster\n"
                                           f"cpus_per_node: {cluster.cpus_per_node}\n")
    return presets


def job_logs(jobs: Path) -> str:
    """The tail of every Slurm log in ``jobs``, for a failure message."""
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}"
                     for log in sorted(jobs.glob("slurm-*")))


def _slurm_local(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": search_path()}
    return subprocess.run(["bash", str(SLURM_LOCAL), *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _short_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # munge's socket (and slurmd's per-step sockets) must fit a Unix socket path: 107 bytes.
    base = tmp_path_factory.mktemp("slurm")
    if len(str(base)) > 60:
        import tempfile

        base = Path(tempfile.mkdtemp(prefix="ns-slurm-"))
    return base


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Slurm on this machine: partition ``debug``, nodes node1 to node3 (NodeAddr 127.0.0.1, RealMemory 2000 MB),
    each with every core of this machine and one fake GPU (GRES), no accounting.

    Yields a :class:`SlurmCluster`; its ``env`` (SLURM_CONF, PATH) is what sbatch and the other
    clients need. Taken down at the end of the session: jobs cancelled, daemons stopped, and
    a daemon that outlived that is killed and reported.
    """
    require(SLURM_COMMANDS, "the Slurm tests")
    base = _short_base(tmp_path_factory)
    started = _slurm_local("up", str(base), "3", "1")
    try:
        if started.returncode != 0:
            pytest.fail(f"scripts/slurm-local.sh up failed ({started.returncode}):\n{started.stdout}\n"
                        f"{started.stderr}", pytrace=False)
        conf = base / "slurm.conf"
        env = {"SLURM_CONF": str(conf), "PATH": search_path()}
        cluster = SlurmCluster(base=base, conf=conf, nodes=3, cpus_per_node=0, gpus_per_node=1, env=env)
        cpus = cluster.command("sinfo", "-h", "-o", "%c").stdout.split()
        cluster.cpus_per_node = int(cpus[0])
        yield cluster
    finally:
        stopped = _slurm_local("down", str(base))
        left = processes_with(str(base))
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if stopped.returncode != 0 or left:
            pytest.fail(f"scripts/slurm-local.sh down {base}: exit {stopped.returncode}, still running "
                        f"(killed): {left}\n{stopped.stderr}", pytrace=False)


# The same class, under the name modules use that start a cluster of their own (another shape than the
# session's): they share no cluster with the slurm_cluster group, so xdist may run them on the other worker.
OwnSlurm = SlurmCluster


@contextlib.contextmanager
def own_slurm_cluster(tmp_path_factory: pytest.TempPathFactory, nodes: int, gpus: int,
                      short_maxtime: str = "") -> Iterator[OwnSlurm]:
    """``scripts/slurm-local.sh up BASE NODES GPUS [SHORT_MAXTIME]``, taken down (and its leftovers killed) after."""
    require(SLURM_COMMANDS, "a Slurm cluster of the module's own")
    base = _short_base(tmp_path_factory)
    started = _slurm_local("up", str(base), str(nodes), str(gpus), *([short_maxtime] if short_maxtime else []))
    try:
        if started.returncode != 0:
            pytest.fail(f"slurm-local.sh up failed:\n{started.stdout}\n{started.stderr}", pytrace=False)
        conf = base / "slurm.conf"
        cpus = int(subprocess.run(["sinfo", "-h", "-o", "%c"], env={**os.environ, "SLURM_CONF": str(conf),
                                  "PATH": search_path()}, capture_output=True, text=True).stdout.split()[0])
        yield OwnSlurm(base=base, conf=conf, nodes=nodes, cpus_per_node=cpus, gpus_per_node=gpus,
                       env={"SLURM_CONF": str(conf), "PATH": search_path()})
    finally:
        _slurm_local("down", str(base))
        for pid in processes_with(str(base)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# --- PBS Pro, by hand --------------------------------------------------------------------------------


@dataclass
class PbsResult:
    """What a PBS job run by :func:`run_pbs_job` left: exit status, output, where daemons started."""

    returncode: int
    output: str
    job_id: str
    home: Path
    output_file: Path | None
    # One entry per node daemon that mpiexec started through the TM stand-in, as "HOST".
    daemons: list[str]


# A stand-in for PBS's TM interface, through which an mpiexec on a PBS cluster starts its daemon
# on every other node: mpiexec calls it as `AGENT [options] HOST COMMAND`, and PBS starts COMMAND
# on HOST in the job's initial environment. Variables the job script exported later (MASTER_ADDR,
# --env values) do not reach it; mpiexec must pass those on itself (Open MPI's -x).
_AGENT = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
echo "$1" >> {log}
shift
exec env -i {env} /bin/sh -c "$*"
"""


def _pbs_environment(scratch: Path, bin_dir: Path, nodefile: Path, job_id: str, job_name: str,
                     workdir: Path) -> dict[str, str]:
    """The environment PBS Pro starts a job script in (no -V: the submitting shell's is not copied)."""
    home = scratch / "home"
    (scratch / "tmp").mkdir()
    env = {
        "HOME": str(home),
        "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin",
                                 "/bin"]),
        "SHELL": "/bin/bash",
        "USER": os.environ.get("USER", "root"),
        "LOGNAME": os.environ.get("LOGNAME", os.environ.get("USER", "root")),
        "TMPDIR": str(scratch / "tmp"),
        "PBS_ENVIRONMENT": "PBS_BATCH",
        "PBS_JOBID": job_id,
        "PBS_JOBNAME": job_name,
        "PBS_NODEFILE": str(nodefile),
        "PBS_O_WORKDIR": str(workdir),
        "PBS_O_HOME": str(home),
        "PBS_O_HOST": socket.gethostname(),
        "PBS_QUEUE": "workq",
    }
    for name in ("LANG", "LC_ALL"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def run_pbs_job(script_path: Path, nodes: int | Sequence[str] = 2, *, scratch: Path, mpiexec: str = "mpich",
                mpiprocs: int = 1, job_id: str | None = None, job_name: str | None = None,
                workdir: Path | None = None, env: dict[str, str] | None = None,
                timeout: float = 180) -> PbsResult:
    """Run ``script_path`` as PBS Pro runs a job on ``nodes`` nodes, with the real ``mpiexec``.

    ``nodes``: a count, or the host names. By default the hosts are 127.0.0.2, 127.0.0.3, ...:
    every 127.x address is this machine, yet each is a node of its own to mpiexec (Open MPI's
    ``--map-by ppr:1:node`` needs as many nodes as processes), and the script resolves the first
    one as the rendezvous address. ``$PBS_NODEFILE`` lists each host ``mpiprocs`` times, as PBS
    writes it for ``select=N:mpiprocs=M``. ``mpiexec``: ``mpich`` (Hydra reads the node file
    itself under PBS) or ``openmpi`` (given the node file as its default host file, as an Open
    MPI built with PBS's TM support finds the nodes). Either starts its node daemons through a
    TM stand-in in the job's initial environment. The script runs with the job's home
    directory as working directory, not the submission directory; its output (PBS's ``-j oe``)
    is also written where ``#PBS -o DIR/`` says, as ``JOBNAME.oSEQ``.
    """
    binary = require([MPIEXEC[mpiexec]], f"a PBS job with {mpiexec} mpiexec")[MPIEXEC[mpiexec]]
    script_path = Path(script_path)
    text = script_path.read_text()
    hosts = [f"127.0.0.{2 + i}" for i in range(nodes)] if isinstance(nodes, int) else list(nodes)
    job_id = job_id or f"{random.randrange(100_000, 1_000_000)}.pbsserver"
    if job_name is None:
        named = re.search(r"^#PBS -N (\S+)", text, re.M)
        job_name = named.group(1) if named else script_path.name
    scratch.mkdir(parents=True, exist_ok=True)
    bin_dir = scratch / "bin"
    bin_dir.mkdir()
    (scratch / "home").mkdir()
    nodefile = scratch / "nodefile"
    nodefile.write_text("".join(f"{host}\n" * mpiprocs for host in hosts))
    job_env = _pbs_environment(scratch, bin_dir, nodefile, job_id, job_name,
                               workdir or Path(os.environ.get("PWD", os.getcwd())))
    job_env.update(env or {})

    daemon_log = scratch / "daemons.log"
    agent = bin_dir / "pbs-tm-agent"
    agent.write_text(_AGENT.format(log=shlex.quote(str(daemon_log)),
                                   env=" ".join(shlex.quote(f"{k}={v}") for k, v in job_env.items())))
    agent.chmod(0o755)
    # A wrapper, not a link: Hydra looks for hydra_pmi_proxy beside the mpiexec it was started as.
    wrapper = bin_dir / "mpiexec"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(binary)} "$@"\n')
    wrapper.chmod(0o755)
    if mpiexec == "mpich":
        job_env.update({"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(agent)})
    else:
        job_env.update({
            "OMPI_MCA_orte_default_hostfile": str(nodefile),
            "OMPI_MCA_plm_rsh_agent": str(agent),
            "OMPI_MCA_rmaps_base_oversubscribe": "1",
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            # Open MPI 4.1's PMIx shared-memory store prints a harmless error under some sandboxes.
            "PMIX_MCA_gds": "hash",
            # Each Open MPI 4.1 daemon maps a shared-memory copy of the hwloc topology at an address it
            # guesses from /proc/self/maps, for MPI programs to adopt. With two daemons on one machine (two
            # "nodes" here) a daemon once died of SIGSEGV in that hwloc shmem code (one full-suite run in
            # about a dozen). The workers are not MPI programs and never read that copy: keep it off.
            "OMPI_MCA_rtc_hwloc_vmhole": "none",
        })

    returncode, output = run_job_script(["/bin/bash", str(script_path)], scratch / "home", job_env, job_id,
                                        timeout, f"PBS job {script_path}")

    output_file = None
    target = re.search(r"^#PBS -o (\S+/)$", text, re.M)
    if target:
        output_file = Path(target.group(1)) / f"{job_name}.o{job_id.split('.')[0]}"
        output_file.parent.mkdir(parents=True, exist_ok=True)
        output_file.write_text(output)
    daemons = daemon_log.read_text().split() if daemon_log.exists() else []
    return PbsResult(returncode, output, job_id, scratch / "home", output_file, daemons)


def run_job_script(argv: Sequence[str], cwd: Path, env: Mapping[str, str], job_id: str, timeout: float,
                   what: str) -> tuple[int, str]:
    """Run a job script as the head node would: exit code and output, killed past ``timeout``.

    Whatever the job left behind (mpiexec daemons, remote proxies) carries PBS_JOBID in its
    environment, as PBS would track it, and is killed afterwards in any case.
    """
    process = subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{what} ran past {timeout:.0f} s (killed)\n{output}", pytrace=False)
    finally:
        _kill_leftovers(f"PBS_JOBID={job_id}")
    return process.returncode, output


def _kill_leftovers(marker: str) -> None:
    needle = marker.encode() + b"\0"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ or environ.endswith(marker.encode()):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def pbs_run(tmp_path: Path):
    """``pbs_run(script_path, nodes=2, mpiexec="mpich", ...)``: :func:`run_pbs_job` in this test's
    temporary folder (a fresh scratch folder per call)."""
    calls = iter(range(1_000))

    def run(script_path: Path, nodes: int | Sequence[str] = 2, **options) -> PbsResult:
        return run_pbs_job(script_path, nodes, scratch=tmp_path / f"pbs-{next(calls)}", **options)

    return run
