"""The job script of every built-in cluster preset in every mode, pinned as golden files.

tests/test_render.py pins scripts of hand-made presets; this file pins what users actually get
from the shipped presets (derecho, lumi, puhti, ...), so that an edit to a preset's YAML or to
a renderer shows up as a reviewed diff. Set NODESCALE_UPDATE_GOLDEN=1 to rewrite
tests/golden/presets/*.sh after an intended change, and read the diff before committing it.

Beside the byte-for-byte comparison, each script is checked by ``bash -n`` and for what a
reviewer checks by eye against the cluster's documentation (the sources cited in each preset
file): the GPU request in the form the cluster takes, the account and queue, the modules, and
for Derecho the NCAR seed's ``mpiexec ... --ppn 1 --cpu-bind none`` launch. Those expectations
are written out here, not read from the preset, so a wrong preset value fails them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import golden_files
from nodescale.launch.presets import builtin_presets, load_preset
from nodescale.launch.render_pbs import render_pbs
from nodescale.launch.render_slurm import render_slurm
from nodescale.launch.spec import JobSpec, Preset

GOLDEN = golden_files.GOLDEN_ROOT / "presets"
MODES = ("torchrun", "per-gpu", "spawn")
PRESETS = ("derecho", "generic-pbs", "generic-slurm", "hipergator", "lumi", "mahti", "puhti")
CASES = [(name, mode) for name in PRESETS for mode in MODES]

ACCOUNT = "project_0001"
COMMAND = ["nodescale", "train", "--model", "resnet50"]

# What each cluster's documentation says a job script must hold (see the sources in the preset
# files): the scheduler, the GPU request for a whole node, the queue (None: the cluster's
# default, so no queue line), the modules in load order, and the cores per node.
CLUSTERS = {
    "derecho": dict(scheduler="pbs", gpu="ngpus=4", queue="main", modules=["cuda", "conda"], cpus=64),
    "generic-pbs": dict(scheduler="pbs", gpu="ngpus=4", queue=None, modules=[], cpus=16),
    "generic-slurm": dict(scheduler="slurm", gpu="--gres=gpu:4", queue=None, modules=[], cpus=16),
    "hipergator": dict(scheduler="slurm", gpu="--gpus-per-node=8", queue="hpg-ai", modules=[], cpus=128),
    "lumi": dict(scheduler="slurm", gpu="--gpus-per-node=8", queue="standard-g", modules=[], cpus=56),
    "mahti": dict(scheduler="slurm", gpu="--gres=gpu:a100:4", queue="gpumedium", modules=["pytorch"], cpus=128),
    "puhti": dict(scheduler="slurm", gpu="--gres=gpu:v100:4", queue="gpu", modules=["pytorch"], cpus=40),
}


@pytest.fixture(autouse=True)
def _no_user_presets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A developer's own ~/.config/nodescale/presets/derecho.yaml would replace the built-in.
    monkeypatch.setenv("NODESCALE_PRESET_DIR", str(tmp_path / "no-user-presets"))


def job_spec(preset: Preset, mode: str) -> JobSpec:
    """The fixed job every golden file is rendered from: whole nodes of the preset's GPUs."""
    return JobSpec(
        scheduler=preset.scheduler, preset=preset.name, nodes=1 if mode == "spawn" else 2,
        gpus_per_node=preset.gpus_per_node, nproc_per_node=preset.gpus_per_node or 1, mode=mode,
        time="01:00:00", account=ACCOUNT, command=COMMAND, workdir=Path("/home/user/project"),
        job_dir=Path("/home/user/project/nodescale-jobs"),
    )


def script_of(name: str, mode: str) -> str:
    preset = load_preset(name)
    render = render_slurm if preset.scheduler == "slurm" else render_pbs
    return render(job_spec(preset, mode), preset)


def check_golden(name: str, text: str) -> None:
    """Compare ``text`` with tests/golden/presets/NAME.sh (see golden_files)."""
    golden_files.check_golden(GOLDEN / f"{name}.sh", text)


def test_every_builtin_preset_is_covered() -> None:
    # A new built-in needs its cluster's expectations above (and its goldens).
    assert sorted(builtin_presets()) == sorted(PRESETS) == sorted(CLUSTERS)


@pytest.mark.parametrize(("preset", "mode"), CASES)
def test_golden(preset: str, mode: str) -> None:
    check_golden(f"{preset}-{mode}", script_of(preset, mode))


def test_goldens_have_no_strays() -> None:
    """Every golden file belongs to a case (a renamed preset or mode leaves none behind).

    After test_golden, so that a run with NODESCALE_UPDATE_GOLDEN=1 has written them all.
    """
    assert sorted(p.stem for p in GOLDEN.glob("*.sh")) == sorted(f"{p}-{m}" for p, m in CASES)


@pytest.mark.parametrize(("preset", "mode"), CASES)
def test_bash_accepts_the_syntax(preset: str, mode: str, tmp_path: Path) -> None:
    bash = shutil.which("bash")
    assert bash, "bash is needed to check the scripts' syntax"
    path = tmp_path / f"{preset}-{mode}.sh"
    path.write_text(script_of(preset, mode))
    checked = subprocess.run([bash, "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr


def directive_lines(text: str, scheduler: str) -> list[str]:
    prefix = "#SBATCH " if scheduler == "slurm" else "#PBS "
    return [line.removeprefix(prefix) for line in text.splitlines() if line.startswith(prefix)]


def launch_line(text: str) -> str:
    """The srun/mpiexec line: the first line of the launch command."""
    return next(line for line in text.splitlines() if line.startswith(("srun ", "mpiexec ")))


@pytest.mark.parametrize(("preset", "mode"), CASES)
def test_what_a_reviewer_checks(preset: str, mode: str) -> None:
    cluster = CLUSTERS[preset]
    text = script_of(preset, mode)
    directives = directive_lines(text, cluster["scheduler"])
    nodes = 1 if mode == "spawn" else 2
    gpus = int(re.search(r"\d+$", cluster["gpu"]).group())
    tasks = gpus if mode == "per-gpu" else 1

    if cluster["scheduler"] == "pbs":
        # One select chunk per node with every GPU and core of it; mpiprocs as the launch starts them.
        select = f"-l select={nodes}:ncpus={cluster['cpus']}:{cluster['gpu']}:mpiprocs={tasks}"
        assert [d for d in directives if d.startswith("-l select=")] == [select], directives
        assert "-l place=scatter" in directives
        assert "-l walltime=01:00:00" in directives
        assert f"-A {ACCOUNT}" in directives
        queues = [d for d in directives if d.startswith("-q ")]
        assert queues == ([f"-q {cluster['queue']}"] if cluster["queue"] else []), directives
        assert "-o /home/user/project/nodescale-jobs/" in directives
        assert 'head_node=$(head -n 1 "$PBS_NODEFILE")' in text
    else:
        gpu_requests = [d for d in directives if d.startswith(("--gres=", "--gpus", "--gpus-per-node="))]
        assert gpu_requests == [cluster["gpu"]], directives
        assert f"--nodes={nodes}" in directives and f"--ntasks-per-node={tasks}" in directives
        assert f"--cpus-per-task={cluster['cpus'] // tasks}" in directives
        assert "--time=01:00:00" in directives
        assert f"--account={ACCOUNT}" in directives
        partitions = [d for d in directives if d.startswith("--partition=")]
        assert partitions == ([f"--partition={cluster['queue']}"] if cluster["queue"] else []), directives

    # Modules load in the preset's order, with -u off, before anything is launched.
    loads = re.findall(r"^module load (\S+)$", text, re.M)
    assert loads == cluster["modules"], loads
    if loads:
        start = text.index("set +u\nmodule load ")
        assert start < text.index("\nset -u\n", start) < text.index(launch_line(text))

    # The user's command arrives as the launch's last words, never re-quoted into the script.
    # (The launch runs in the background, " &", and the requeue handling follows it.)
    assert f" {' '.join(COMMAND)} &\n" in text, text[-200:]
    assert text.startswith("#!/bin/bash\n") and "\nset -euo pipefail\n" in text
    assert "\ncd /home/user/project\n" in text


def test_derecho_launches_like_the_ncar_seed() -> None:
    """Seed 001: ``mpiexec -n $nnodes --ppn 1 --cpu-bind none torchrun --nnodes=$nnodes ... --rdzv-backend=c10d
    --rdzv-endpoint=$head_node_ip``, with the head's address from $PBS_NODEFILE."""
    text = script_of("derecho", "torchrun")
    launch = launch_line(text)
    assert launch == "mpiexec -n 2 --ppn 1 --cpu-bind none --label \\", launch
    after = text[text.index(launch):]
    assert "exec torchrun --nnodes=2 --nproc-per-node=4 \\" in after
    assert '--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"' in after
    before = text[:text.index(launch)]
    assert 'head_node=$(head -n 1 "$PBS_NODEFILE")' in before and "export MASTER_ADDR MASTER_PORT" in before
    # Per-gpu mode: one PALS rank per GPU, still unbound (the preset's binding is "none").
    assert launch_line(script_of("derecho", "per-gpu")) == "mpiexec -n 8 --ppn 4 --cpu-bind none --label \\"
    # The NCAR docs: GPU jobs load cuda "or nodes may lock up"; /tmp is small and shared.
    assert 'export TMPDIR="${SCRATCH}/temp" && mkdir -p "${TMPDIR}"' in text
    for name in ("NCCL_SOCKET_IFNAME=hsn", "NCCL_IB_DISABLE=1", "NCCL_CROSS_NIC=1", "MPICH_GPU_SUPPORT_ENABLED=1"):
        assert f"\nexport {name}\n" in text, name


def test_lumi_binds_cpus_per_gcd_only_with_one_task_per_gcd() -> None:
    """The per-GCD mask list describes 8 tasks; a torchrun task per node would be pinned to 7 cores."""
    assert "--cpu-bind=mask_cpu:0xfe000000000000,0xfe00000000000000," in launch_line(script_of("lumi", "per-gpu"))
    for mode in ("torchrun", "spawn"):
        assert "--cpu-bind" not in script_of("lumi", mode), mode
