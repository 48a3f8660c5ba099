"""The sbatch and qsub scripts of ``nodescale launch``: goldens, quoting, and what they do when run.

Golden files (tests/golden/launch/*.sh) pin the full text for four cluster presets x three
modes; set NODESCALE_UPDATE_GOLDEN=1 to rewrite them after an intended change.

The scripts are also executed, with stub ``srun``/``mpiexec``/``scontrol``/``torchrun``/
``singularity``/``module`` executables on PATH that record their argv and environment as JSON
lines and then start what they were given the way the real ones would (one copy per node or
task, with the scheduler's variables set). Where Open MPI or MPICH is installed, the PBS
per-node and per-task launches also run under the real ``mpiexec`` on one node.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import golden_files
from nodescale.distributed.env import port_for_job
from nodescale.errors import UserError
from nodescale.launch import numa_binding, shell
from nodescale.launch.render_pbs import render_pbs, walltime
from nodescale.launch.render_slurm import render_slurm
from nodescale.launch.spec import Container, JobSpec, Preset
from scheduler_fixtures import require

GOLDEN = golden_files.GOLDEN_ROOT / "launch"
MODES = ("torchrun", "per-gpu", "spawn")

# --- presets, one per kind of cluster the seeds use -------------------------------------------

PRESETS = {
    # CSC Puhti-like: Slurm, --gres=gpu:v100:4, modules.
    "slurm-gres": Preset(
        name="slurm-gres", scheduler="slurm", gpus_per_node=4, cpus_per_node=40, gpu_request="gres",
        gpu_type="v100", queue="gpu", account_required=True, directives=["--mem=0"],
        modules=["pytorch/2.1"], env={"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "10"},
    ),
    # LUMI-like: Slurm, --gpus-per-node, Singularity, per-GCD CPU masks.
    "slurm-container": Preset(
        name="slurm-container", scheduler="slurm", gpus_per_node=8, cpus_per_node=56,
        gpu_request="gpus-per-node", queue="standard-g", directives=["--exclusive"],
        cpu_bind="mask_cpu:0xfe000000000000,0xfe00000000000000,0xfe0000,0xfe000000,0xfe,0xfe00,0xfe00000000,"
        "0xfe0000000000",
        env={"NCCL_SOCKET_IFNAME": "hsn", "MIOPEN_USER_DB_PATH": "/tmp/miopen"},
        container=Container(
            image="/appl/local/containers/pytorch.sif", binds=["/pfs", "/scratch", "/projappl"],
            setup=["$WITH_CONDA", "source /projappl/project_465000001/venv/bin/activate"],
        ),
    ),
    # NCAR Derecho-like: PBS Pro, Cray PALS mpiexec, ngpus, NCCL/libfabric variables.
    "pbs-pals": Preset(
        name="pbs-pals", scheduler="pbs", gpus_per_node=4, cpus_per_node=64, gpu_request="pbs-ngpus",
        queue="main", account_required=True, mpiexec="pals", modules=["conda", "cuda/12.2"],
        setup=["conda activate /glade/work/user/envs/torch"], directives=["-l job_priority=regular"],
        env={"NCCL_SOCKET_IFNAME": "hsn", "NCCL_CROSS_NIC": "1", "FI_CXI_DISABLE_HOST_REGISTER": "1",
             "MPICH_GPU_SUPPORT_ENABLED": "1"},
    ),
    # A CPU PBS cluster with Open MPI.
    "pbs-openmpi": Preset(
        name="pbs-openmpi", scheduler="pbs", gpus_per_node=0, cpus_per_node=32, gpu_request="none",
        queue="workq", mpiexec="openmpi", env={"GLOO_SOCKET_IFNAME": "ib0"},
    ),
}

COMMAND = ["nodescale", "train", "--config", "/home/user/project/resnet.yaml", "--set", "epochs=3"]


def golden_spec(preset: Preset, mode: str) -> JobSpec:
    """The fixed job each golden file is rendered from."""
    gpus = preset.gpus_per_node
    return JobSpec(
        scheduler=preset.scheduler, preset=preset.name, nodes=1 if mode == "spawn" else 2,
        gpus_per_node=gpus, nproc_per_node=gpus or 4, mode=mode, time="02:30:00", account="proj_123",
        job_name="resnet ddp", env={"OMP_NUM_THREADS": "8", "RUN_NOTE": "lr 0.1, 'warm' start"},
        command=COMMAND, workdir=Path("/home/user/project"), job_dir=Path("/home/user/project/runs/resnet-ddp"),
    )


def render(spec: JobSpec, preset: Preset) -> str:
    return render_slurm(spec, preset) if preset.scheduler == "slurm" else render_pbs(spec, preset)


CASES = [(name, mode) for name in PRESETS for mode in MODES]


def check_golden(name: str, text: str) -> None:
    """Compare ``text`` with tests/golden/launch/NAME.sh (see golden_files)."""
    golden_files.check_golden(GOLDEN / f"{name}.sh", text)


@pytest.mark.parametrize(("preset", "mode"), CASES)
def test_golden(preset: str, mode: str) -> None:
    check_golden(f"{preset}-{mode}", render(golden_spec(PRESETS[preset], mode), PRESETS[preset]))


def test_goldens_have_no_strays() -> None:
    """Every golden file belongs to a case (a renamed case leaves none behind)."""
    assert sorted(p.stem for p in GOLDEN.glob("*.sh")) == sorted(f"{p}-{m}" for p, m in CASES)


def bash_n(text: str, tmp_path: Path) -> None:
    script = tmp_path / "check.sh"
    script.write_text(text)
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_script_parses(tmp_path: Path) -> None:
    for name, mode in CASES:
        bash_n(render(golden_spec(PRESETS[name], mode), PRESETS[name]), tmp_path)


# --- directives ---------------------------------------------------------------------------------


def directive_lines(text: str, prefix: str) -> list[str]:
    return [line[len(prefix) + 1:] for line in text.splitlines() if line.startswith(prefix + " ")]


def test_slurm_directives_by_mode_and_gpu_request() -> None:
    gres = PRESETS["slurm-gres"]
    lines = directive_lines(render(golden_spec(gres, "per-gpu"), gres), "#SBATCH")
    assert lines == [
        "--job-name=resnet_ddp", "--nodes=2", "--ntasks-per-node=4", "--cpus-per-task=10", "--gres=gpu:v100:4",
        "--time=02:30:00", "--account=proj_123", "--partition=gpu",
        "--output=/home/user/project/runs/resnet-ddp/slurm-%j.out",
        "--error=/home/user/project/runs/resnet-ddp/slurm-%j.err",
        "--signal=B:USR1@120", "--requeue", "--open-mode=append",  # preemption: signal ahead, requeue
        "--mem=0",
    ]
    untyped = gres.model_copy(update={"gpu_type": None})
    spec = golden_spec(gres, "torchrun").model_copy(update={"queue": "debug", "account": None})
    lines = directive_lines(render(spec, untyped), "#SBATCH")
    assert "--gres=gpu:4" in lines and "--ntasks-per-node=1" in lines and "--cpus-per-task=40" in lines
    assert "--partition=debug" in lines and not any(line.startswith("--account") for line in lines)
    lumi = PRESETS["slurm-container"]
    assert "--gpus-per-node=8" in directive_lines(render(golden_spec(lumi, "spawn"), lumi), "#SBATCH")
    cpu = gres.model_copy(update={"gpu_request": "none"})
    lines = directive_lines(render(golden_spec(gres, "spawn"), cpu), "#SBATCH")
    assert not any(line.startswith(("--gres", "--gpus")) for line in lines)
    no_gpus = golden_spec(gres, "spawn").model_copy(update={"gpus_per_node": 0})
    assert not any("gres" in line for line in directive_lines(render(no_gpus, gres), "#SBATCH"))


def test_pbs_directives_by_mode_and_gpu_request() -> None:
    pals = PRESETS["pbs-pals"]
    lines = directive_lines(render(golden_spec(pals, "per-gpu"), pals), "#PBS")
    assert lines == [
        "-N resnet_ddp", "-l select=2:ncpus=64:ngpus=4:mpiprocs=4", "-l place=scatter", "-l walltime=02:30:00",
        "-A proj_123", "-q main", "-j oe", "-o /home/user/project/runs/resnet-ddp/", "-l job_priority=regular",
    ]
    lines = directive_lines(render(golden_spec(pals, "torchrun"), pals), "#PBS")
    assert "-l select=2:ncpus=64:ngpus=4:mpiprocs=1" in lines
    ompi = PRESETS["pbs-openmpi"]
    lines = directive_lines(render(golden_spec(ompi, "torchrun"), ompi), "#PBS")
    assert "-l select=2:ncpus=32:mpiprocs=1" in lines
    placed = pals.model_copy(update={"directives": ["-l place=scatter:excl"]})
    lines = directive_lines(render(golden_spec(pals, "torchrun"), placed), "#PBS")
    assert lines.count("-l place=scatter:excl") == 1 and "-l place=scatter" not in lines


def test_pbs_walltime_has_no_days() -> None:
    assert walltime("1-02:00:00") == "26:00:00"
    assert walltime("0-00:30:00") == "00:30:00"
    assert walltime("100:00:00") == "100:00:00"


def test_pbs_cd_to_absolute_workdir_not_pbs_o_workdir() -> None:
    pals = PRESETS["pbs-pals"]
    text = render(golden_spec(pals, "torchrun"), pals)
    assert "\ncd /home/user/project\n" in text
    assert "cd $PBS_O_WORKDIR" not in text and 'cd "$PBS_O_WORKDIR"' not in text


def test_user_env_wins_and_is_exported_once() -> None:
    gres = PRESETS["slurm-gres"]
    text = render(golden_spec(gres, "torchrun"), gres)
    assert re.findall(r"^export OMP_NUM_THREADS=.*$", text, re.M) == ["export OMP_NUM_THREADS=8"]
    assert text.index("export NCCL_DEBUG=WARN") < text.index("export OMP_NUM_THREADS=8")


def test_explicit_master_addr_and_port_are_kept() -> None:
    gres = PRESETS["slurm-gres"]
    spec = golden_spec(gres, "torchrun").model_copy(update={"env": {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "23456"}})
    text = render(spec, gres)
    assert "MASTER_ADDR=$(" not in text and "MASTER_PORT=$(" not in text
    assert "export MASTER_ADDR=10.0.0.1" in text and "export MASTER_PORT=23456" in text


def test_per_task_cpu_masks_only_in_per_gpu_mode() -> None:
    lumi = PRESETS["slurm-container"]
    assert "--cpu-bind=mask_cpu:" in render(golden_spec(lumi, "per-gpu"), lumi)
    for mode in ("torchrun", "spawn"):
        assert "--cpu-bind" not in render(golden_spec(lumi, mode), lumi)
    plain = lumi.model_copy(update={"cpu_bind": "none"})
    assert "--cpu-bind=none" in render(golden_spec(lumi, "torchrun"), plain)


@pytest.mark.parametrize("flavour", ["pals", "mpich", "openmpi"])
def test_mpiexec_flags_by_flavour(flavour: str) -> None:
    preset = PRESETS["pbs-pals"].model_copy(update={"mpiexec": flavour})
    line = next(line for line in render(golden_spec(preset, "per-gpu"), preset).splitlines()
                if line.startswith("mpiexec "))
    expected = {
        "pals": "mpiexec -n 8 --ppn 4 --cpu-bind none --label \\",
        "mpich": "mpiexec -n 8 -ppn 4 -bind-to none -prepend-rank \\",  # Hydra refuses --cpu-bind
        # Hosts from the node file (Open MPI without PBS TM sees only the local host otherwise),
        # and the job id passed on: it is the rendezvous id on every node.
        "openmpi": 'mpiexec -n 8 --hostfile "$PBS_NODEFILE" --map-by ppr:4:node --bind-to none --tag-output '
                   "-x PATH -x MASTER_ADDR -x MASTER_PORT -x PBS_JOBID",
    }[flavour]
    assert line.startswith(expected)


# --- refusals -------------------------------------------------------------------------------------


def test_spawn_on_several_nodes_is_refused_by_the_dry_run() -> None:
    from nodescale.launch.schedulers.table import BATCH

    for preset in (PRESETS["slurm-gres"], PRESETS["pbs-pals"]):
        spec = golden_spec(preset, "spawn").model_copy(update={"nodes": 2})
        with pytest.raises(UserError, match="one node"):
            BATCH[preset.scheduler].dryrun(spec, preset)


def test_wrong_scheduler_and_relative_paths_are_refused() -> None:
    spec = golden_spec(PRESETS["pbs-pals"], "torchrun")
    with pytest.raises(ValueError, match="cannot use"):
        render_slurm(spec, PRESETS["slurm-gres"])
    with pytest.raises(ValueError, match="absolute"):
        render_pbs(spec.model_copy(update={"workdir": Path("project")}), PRESETS["pbs-pals"])


@pytest.mark.parametrize("preset", ["slurm-gres", "pbs-pals"])
@pytest.mark.parametrize(
    "update",
    [
        {"env": {"BAD;NAME": "x"}},
        {"env": {"1X": "x"}},
        {"job_dir": Path("/home/user/runs\n#SBATCH --wrap=x")},
        {"account": "proj\n$(touch /tmp/pwned)"},
        {"queue": "q\rx"},
        {"command": ["--help"]},
    ],
)
def test_unwritable_values_are_user_errors(preset: str, update: dict[str, Any]) -> None:
    spec = golden_spec(PRESETS[preset], "torchrun").model_copy(update=update)
    with pytest.raises(UserError):
        render(spec, PRESETS[preset])


def test_pbs_directive_values_with_spaces_are_user_errors() -> None:
    spec = golden_spec(PRESETS["pbs-pals"], "torchrun").model_copy(update={"account": "my proj"})
    with pytest.raises(UserError, match="#PBS"):
        render(spec, PRESETS["pbs-pals"])


def test_preset_directive_with_newline_is_refused() -> None:
    preset = PRESETS["slurm-gres"].model_copy(update={"directives": ["--mem=0\necho injected"]})
    with pytest.raises(UserError):
        render(golden_spec(preset, "torchrun"), preset)


# --- the port rule in shell ------------------------------------------------------------------------


def test_the_scripts_port_program_matches_port_for_job() -> None:
    ids = ["1", "1234", "14999", "15000", "29999", "0123", "1234.desched1", "1234[5].server", "1234[].server",
           "987654321[17].pbs01", "  4242 ", "4242_7", "", "   ", "abc.server", "job-x"]
    # As the script runs it: a python3 one-liner in a shell word, the job id as its argument.
    program = "\n".join(f"python3 -c {shell.quote(shell.port_program())} {shell.quote(i)}" for i in ids)
    result = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True)
    assert [int(p) for p in result.stdout.split()] == [port_for_job(i) for i in ids]


# --- running the scripts with stub launchers --------------------------------------------------------

RECORDER = """\
import json, os, sys
WATCH = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
         "MASTER_PORT", "RUN_NOTE", "NCCL_DEBUG", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
         "IN_CONTAINER")
def record(name=None):
    entry = {"prog": name or os.path.basename(sys.argv[0]), "argv": sys.argv[1:], "cwd": os.getcwd(),
             "env": {k: os.environ[k] for k in WATCH if k in os.environ}}
    with open(os.environ["NODESCALE_TEST_RECORD"], "a") as f:
        f.write(json.dumps(entry) + "\\n")
"""

STUBS = {
    # The user's program and torchrun: record and succeed.
    "tool": "record()",
    "torchrun": "record()",
    "module": "record()",
    "conda": "record()",
    # scontrol: fake node names that do not resolve; NodeAddr as the test Slurm cluster has it.
    "scontrol": """\
record()
args = sys.argv[1:]
if args[:2] == ["show", "hostnames"]:
    print("fakenode-a\\nfakenode-b" if args[2] == "fakenode-[a-b]" else args[2])
elif args[:2] == ["show", "node"]:
    addr = os.environ.get("STUB_NODEADDR", "127.0.0.1")
    print(f"NodeName={args[2]} Arch=x86_64 CoresPerSocket=1")
    if addr:
        print(f"   NodeAddr={addr} NodeHostName={args[2]} Version=22.05.8")
else:
    sys.exit(1)
""",
    # srun: one copy of the rest per task, with the variables Slurm sets in each.
    "srun": """\
import subprocess
record()
args, opts = sys.argv[1:], {}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
nodes = int(opts.get("nodes", 1))
per_node = int(opts.get("ntasks-per-node", int(opts.get("ntasks", nodes)) // nodes))
rc = 0
for node in range(nodes):
    for local in range(per_node):
        env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node * per_node + local),
                   SLURM_LOCALID=str(local), SLURM_NTASKS=str(nodes * per_node), SLURM_STEP_ID="0")
        rc = max(rc, subprocess.run(args, env=env).returncode)
sys.exit(rc)
""",
    # mpiexec: PALS, Hydra or Open MPI variables, told apart by the flags the script used.
    "mpiexec": """\
import subprocess
record()
args, total, per_node, flavour = sys.argv[1:], 1, 1, "pals"
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag in ("--label", "-prepend-rank", "--tag-output"):  # the rank labels take no value
        continue
    value = args.pop(0)
    if flag == "-n":
        total = int(value)
    elif flag in ("--ppn", "-ppn"):
        per_node, flavour = int(value), ("mpich" if flag == "-ppn" else "pals")
    elif flag == "--map-by":
        per_node, flavour = int(value.split(":")[1]), "openmpi"
rc = 0
for rank in range(total):
    node, local = divmod(rank, per_node)
    extra = {
        "pals": {"PALS_RANKID": rank, "PALS_LOCAL_RANKID": local, "PALS_NODEID": node, "PMI_RANK": rank},
        "mpich": {"PMI_RANK": rank, "MPI_LOCALRANKID": local, "PMI_SIZE": total},
        "openmpi": {"OMPI_COMM_WORLD_RANK": rank, "OMPI_COMM_WORLD_LOCAL_RANK": local},
    }[flavour]
    env = dict(os.environ, **{k: str(v) for k, v in extra.items()})
    rc = max(rc, subprocess.run(args, env=env).returncode)
sys.exit(rc)
""",
    # singularity exec [--bind B] IMAGE PROGRAM...: run PROGRAM (there is no image here).
    "singularity": """\
record()
args = sys.argv[2:]
if args[0] == "--bind":
    args = args[2:]
os.execvp(args[1], args[1:])
""",
}


@pytest.fixture(scope="module")
def stub_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of stub launchers (see STUBS), each a Python script."""
    directory = tmp_path_factory.mktemp("stub-bin")
    for name, body in STUBS.items():
        path = directory / name
        path.write_text(f"#!{sys.executable}\n{RECORDER}\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return directory


def run_script(text: str, tmp_path: Path, bin_dirs: list[Path], env: dict[str, str]) -> list[dict[str, Any]]:
    """Run a rendered script as the scheduler would; return what the stubs recorded."""
    script = tmp_path / "job.sh"
    script.write_text(text)
    record = tmp_path / "record.jsonl"
    record.unlink(missing_ok=True)
    run_env = {
        "PATH": os.pathsep.join([*map(str, bin_dirs), os.environ["PATH"]]),
        "HOME": str(tmp_path), "NODESCALE_TEST_RECORD": str(record),
        # Left over from an earlier run in the submitting shell: the script must clear them.
        "RANK": "7", "WORLD_SIZE": "9", "MASTER_PORT": "1",
        **env,
    }
    cwd = tmp_path / "submitted-from"
    cwd.mkdir(exist_ok=True)
    result = subprocess.run(["bash", str(script)], cwd=cwd, env=run_env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert re.search(r"^nodescale: rendezvous at \S+:\d+$", result.stdout, re.M), result.stdout
    return [json.loads(line) for line in record.read_text().splitlines()]


def hostile(tmp_path: Path) -> str:
    """A string that runs commands if any shell evaluates it instead of passing it on."""
    return (f"$(touch {tmp_path}/pwned-1) `touch {tmp_path}/pwned-2`; touch {tmp_path}/pwned-3 && "
            f"'single' \"double\" \\back\\slash $HOME ${{HOME}} * ~ #hash %j é\nsecond line\n")


def scheduler_env(preset: Preset, tmp_path: Path, job_id: str) -> dict[str, str]:
    if preset.scheduler == "slurm":
        return {"SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": "fakenode-[a-b]"}
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("localhost\nlocalhost\nfakenode-b\nfakenode-b\n")
    return {"PBS_JOBID": job_id, "PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(tmp_path)}


def hostile_spec(preset: Preset, mode: str, tmp_path: Path, tool: Path) -> JobSpec:
    evil = hostile(tmp_path)
    # A directory name holds no "/", so its commands touch relative paths (under tmp_path: the
    # script starts in tmp_path/submitted-from).
    workdir = tmp_path / "work $(touch pwned-4) `touch pwned-5`; touch pwned-6 'q' \"d\" \\ #h %j é\nnl"
    workdir.mkdir(exist_ok=True)
    # Directive values cannot hold newlines (the scheduler reads them line by line); Slurm's can
    # hold anything else.
    job_dir = tmp_path / ("logs $(touch x) `y`; 'q' \"d\" #h %p" if preset.scheduler == "slurm" else "logs")
    return golden_spec(preset, mode).model_copy(update={
        "job_name": evil, "workdir": workdir, "job_dir": job_dir,
        "env": {"RUN_NOTE": evil, "OMP_NUM_THREADS": "3"}, "command": [str(tool), evil, "", "plain", evil * 2],
    })


def slurm_directive_args(line: str) -> list[str]:
    """Split an #SBATCH line the way sbatch does (src/sbatch/opt.c _get_argument).

    Only ASCII whitespace separates words: sbatch tests bytes with C's ``isspace``, which is
    false for the UTF-8 bytes of U+0085 or U+00A0, where Python's ``str.isspace`` is true.
    """
    args, current, quote_char, escaped, have = [], [], "", False, False
    for char in line:
        if escaped:
            current.append(char)
            escaped = False
        elif char == "\\":
            escaped, have = True, True
        elif quote_char:
            if char == quote_char:
                quote_char = ""
            else:
                current.append(char)
        elif char in "\"'":
            quote_char, have = char, True
        elif char == "#":
            break
        elif char in " \t\n\r\f\v":
            if current or have:
                args.append("".join(current))
            current, have = [], False
        else:
            current.append(char)
    if current or have:
        args.append("".join(current))
    return args


def runnable(preset: Preset) -> Preset:
    """``preset`` with container setup lines that can run here (and hold a single quote)."""
    if preset.container is None:
        return preset
    container = preset.container.model_copy(update={"setup": ["export IN_CONTAINER=\"it's set up\""]})
    return preset.model_copy(update={"container": container})


def job_id_for(preset: Preset) -> str:
    return "31337" if preset.scheduler == "slurm" else "31337[4].desched1"


@pytest.mark.parametrize(("preset", "mode"), CASES)
def test_scripts_run_with_stub_launchers(preset: str, mode: str, tmp_path: Path, stub_bin: Path) -> None:
    """Each script, run with hostile names, paths, values and arguments: the command and the
    values arrive byte for byte, nothing is executed, and each mode starts what it should."""
    cluster = runnable(PRESETS[preset])
    spec = hostile_spec(cluster, mode, tmp_path, stub_bin / "tool")
    text = render(spec, cluster)
    bash_n(text, tmp_path)
    prefix = "#SBATCH" if cluster.scheduler == "slurm" else "#PBS"
    name = next(line for line in directive_lines(text, prefix) if line.startswith(("--job-name=", "-N ")))
    assert re.fullmatch(r"(--job-name=|-N )[A-Za-z0-9_.+-]+", name)
    if cluster.scheduler == "slurm":
        output = next(line for line in directive_lines(text, prefix) if line.startswith("--output="))
        assert slurm_directive_args(output) == [f"--output={str(spec.job_dir).replace('%', '%%')}/slurm-%j.out"]

    job_id = job_id_for(cluster)
    records = run_script(text, tmp_path, [stub_bin], scheduler_env(cluster, tmp_path, job_id))
    assert not list(tmp_path.rglob("pwned-*")), "a hostile string was executed"
    if mode == "torchrun":
        # The torchrun stub does not start the program: its argv ends with the command.
        runs = [r for r in records if r["prog"] == "torchrun"]
        check_torchrun_runs(runs, spec, job_id)
    else:
        runs = [r for r in records if r["prog"] == "tool"]
        assert [r["argv"] for r in runs] == [spec.command[1:]] * (1 if mode == "spawn" else spec.world_size)
    if mode == "per-gpu":
        check_ranks(runs, spec)
    for run in runs:
        assert run["cwd"] == str(spec.workdir)
        assert run["env"]["RUN_NOTE"] == spec.env["RUN_NOTE"]
        assert run["env"]["OMP_NUM_THREADS"] == "3"
        assert run["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert run["env"]["MASTER_PORT"] == str(port_for_job(job_id))
    if cluster.container:
        assert all(run["env"]["IN_CONTAINER"] == "it's set up" for run in runs)
        assert {tuple(r["argv"][:4]) for r in records if r["prog"] == "singularity"} == {
            ("exec", "--bind", "/pfs,/scratch,/projappl", "/appl/local/containers/pytorch.sif")}
    if cluster.modules:
        assert [r["argv"] for r in records if r["prog"] == "module"] == [["load", m] for m in cluster.modules]
    if cluster.setup:
        assert [r["argv"] for r in records if r["prog"] == "conda"] == [["activate", "/glade/work/user/envs/torch"]]


def torch_has_numa_binding() -> bool:
    """What the scripts ask on each node (``python3 -m nodescale.launch.numa_binding``)."""
    return numa_binding.applies(Path(torch.__file__).parent)


def fake_node(root: Path, numa_nodes: int, gpu_numa: list[str], torch_build: str) -> tuple[Path, Path]:
    """A /sys with ``numa_nodes`` NUMA nodes and NVIDIA GPUs on ``gpu_numa``, and a torch dir of ``torch_build``."""
    for node in range(numa_nodes):
        (root / "sys/devices/system/node" / f"node{node}").mkdir(parents=True)
    for index, numa in enumerate(["", *gpu_numa]):  # first: the board's VGA controller, not a GPU
        device = root / "sys/bus/pci/devices" / f"0000:{index:02x}:00.0"
        device.mkdir(parents=True)
        (device / "vendor").write_text("0x1a03\n" if index == 0 else "0x10de\n")
        (device / "class").write_text("0x030000\n" if index == 0 else "0x030200\n")
        (device / "numa_node").write_text(f"{numa or 0}\n")
    torch_dir = root / "torch"
    (torch_dir / "numa").mkdir(parents=True)
    (torch_dir / "numa" / "binding.py").write_text("")
    (torch_dir / "version.py").write_text(f"cuda: Optional[str] = {torch_build}\nhip: Optional[str] = None\n")
    return torch_dir, root / "sys"


@pytest.mark.parametrize(("numa_nodes", "gpu_numa", "build", "binds"), [
    (2, ["0", "1"], "'12.8'", True),
    (2, ["0", "1"], "None", False),  # a CPU torch on nodes with GPU gres: binding would fail the step
    (1, ["0", "0"], "'12.8'", False),  # one NUMA node: nothing to choose
    (2, ["0", "-1"], "'12.8'", False),  # a GPU on an unknown node (VMs): torchrun would fail
    (2, [], "'12.8'", False),
])
def test_numa_binding_only_where_it_can_work(tmp_path: Path, numa_nodes: int, gpu_numa: list[str], build: str,
                                             binds: bool) -> None:
    torch_dir, sys_root = fake_node(tmp_path, numa_nodes, gpu_numa, build)
    assert numa_binding.applies(torch_dir, sys_root) is binds
    (torch_dir / "numa" / "binding.py").unlink()  # a torch without the option
    assert not numa_binding.applies(torch_dir, sys_root)


def check_torchrun_runs(runs: list[dict[str, Any]], spec: JobSpec, job_id: str) -> None:
    """One torchrun per node, with that node's store role and address, then the command."""
    assert len(runs) == spec.nodes
    for node, run in enumerate(runs):
        split = run["argv"].index("--no-python")
        assert run["argv"][:split] == [
            f"--nnodes={spec.nodes}", f"--nproc-per-node={spec.nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port_for_job(job_id)}", f"--rdzv-id={job_id}",
            f"--rdzv-conf=is_host={1 if node == 0 else 0}", "--local-addr=127.0.0.1", "--tee=3",
            *(["--numa-binding=node"] if spec.gpus_per_node and torch_has_numa_binding() else []),
        ]
        assert run["argv"][split + 1:] == spec.command
        assert "RANK" not in run["env"] and "WORLD_SIZE" not in run["env"]  # stale ones were cleared


def check_ranks(runs: list[dict[str, Any]], spec: JobSpec) -> None:
    """torchrun's variables, one task per process, in rank order."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")
    got = [{k: r["env"].get(k) for k in keys} for r in runs]
    per_node = spec.nproc_per_node
    assert got == [
        {"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": str(spec.world_size),
         "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node), "NODE_RANK": str(rank // per_node)}
        for rank in range(spec.world_size)
    ]


@pytest.mark.parametrize(
    ("nodelist", "node_addr", "expected"),
    [
        ("localhost", "10.1.2.3", "10.1.2.3"),  # NodeAddr wins over the name
        ("fakenode-[a-b]", "localhost", "127.0.0.1"),  # a NodeAddr that is a name is resolved
        ("localhost", "", "127.0.0.1"),  # no NodeAddr: the node name, resolved
        ("fakenode-[a-b]", "", "fakenode-a"),  # nothing resolves: the name itself
    ],
)
def test_slurm_head_address(nodelist: str, node_addr: str, expected: str, tmp_path: Path, stub_bin: Path) -> None:
    cluster = PRESETS["slurm-gres"]
    spec = hostile_spec(cluster, "spawn", tmp_path, stub_bin / "tool")
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": nodelist, "STUB_NODEADDR": node_addr}
    (tool,) = [r for r in run_script(render(spec, cluster), tmp_path, [stub_bin], env) if r["prog"] == "tool"]
    assert tool["env"]["MASTER_ADDR"] == expected


# --- the real mpiexec, one node ---------------------------------------------------------------------


@pytest.mark.parametrize(("flavour", "binary"), [("mpich", "mpiexec.mpich"), ("openmpi", "mpiexec.openmpi")])
@pytest.mark.parametrize("mode", ["torchrun", "per-gpu"])
def test_real_mpiexec_one_node(flavour: str, binary: str, mode: str, tmp_path: Path, stub_bin: Path) -> None:
    real = require([binary], "the real mpiexec test")[binary]
    bin_dir = tmp_path / "real-bin"
    bin_dir.mkdir()
    # A wrapper, not a symlink: Hydra finds its proxy next to the path it was started as.
    wrapper = bin_dir / "mpiexec"
    wrapper.write_text(f'#!/bin/sh\nexec {shell.quote(os.path.realpath(real))} "$@"\n')
    wrapper.chmod(0o755)
    cluster = PRESETS["pbs-openmpi"].model_copy(update={"mpiexec": flavour})
    spec = hostile_spec(cluster, mode, tmp_path, stub_bin / "tool").model_copy(update={"nodes": 1,
                                                                                      "nproc_per_node": 2})
    # Test machines run as root; production scripts keep Open MPI's flags clean.
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env = {**scheduler_env(cluster, tmp_path, "9001.pbs"), **root, "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    # One node: its slots only (Open MPI reads the node file as its host file).
    Path(env["PBS_NODEFILE"]).write_text("localhost\nlocalhost\n")
    records = run_script(render(spec, cluster), tmp_path, [bin_dir, stub_bin], env)
    assert not list(tmp_path.rglob("pwned-*"))
    if mode == "torchrun":
        check_torchrun_runs([r for r in records if r["prog"] == "torchrun"], spec, "9001.pbs")
    else:
        tools = sorted((r for r in records if r["prog"] == "tool"), key=lambda r: int(r["env"]["RANK"]))
        check_ranks(tools, spec)
        assert all(r["argv"] == spec.command[1:] and r["env"]["RUN_NOTE"] == spec.env["RUN_NOTE"] for r in tools)
