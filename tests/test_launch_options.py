"""``launch``'s scheduler options and software flags, rendered: goldens, precedence over the preset's
directives, what PBS Pro cannot ask for, the flags' validation, and the submitting environment's activation.

Goldens: tests/golden/launch_options/*.sh, one Slurm and one PBS script that use every new flag
(NODESCALE_UPDATE_GOLDEN=1 rewrites them). Real jobs with these flags: tests/test_launch_schedulers.py.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import warnings
from pathlib import Path
from typing import Any

import pytest

import golden_files
from nodescale.cli.main import main
from nodescale.errors import UserError
from nodescale.launch.job_options import PythonEnv, SchedulerOptions, Software, hosts
from nodescale.launch.option_directives import pbs_key, slurm_key
from nodescale.launch.software import submitting_python_env
from test_render import PRESETS, bash_n, directive_lines, golden_spec, render

GOLDEN = golden_files.GOLDEN_ROOT / "launch_options"

SLURM_OPTIONS = SchedulerOptions(
    mem="64G", constraint="a100&ib", exclude=["node[01-02],node7"], nodelist=["gpu3"], qos="high",
    reservation="maint_2026", dependency="afterok:4815162:4815163,afterany:4815170", mail_type=["end", "FAIL"],
    mail_user="alice@example.org", directives=["--licenses=scratch:1", "--exclusive"], cpus_per_task=6)
PBS_OPTIONS = SchedulerOptions(
    mem="500M", nodelist=["dec0001"], reservation="R123456", dependency="afterok:4815162.desched1",
    mail_type=["BEGIN", "END", "FAIL"], mail_user="alice", directives=["-l job_priority=premium", "-p 100"],
    cpus_per_task=16)
SOFTWARE = Software(lines=[("module", "cuda/12.2"), ("module", "nccl aws"),
                           ("setup", "export TMPDIR=/scratch/$USER/tmp")],
                    container="/images/torch 2.6.sif", container_binds=["/scratch", "/data:/mnt/data"])


def spec_with(preset: str, mode: str, options: SchedulerOptions | None = None, software: Software | None = None,
              **update: Any):
    return golden_spec(PRESETS[preset], mode).model_copy(
        update={"options": options or SchedulerOptions(), "software": software or Software(), **update})


VENV = PythonEnv(kind="venv", prefix="/home/user/venvs/torch")
CONDA = PythonEnv(kind="conda", prefix="/glade/work/user/envs/nodescale", conda_exe="/glade/u/apps/conda/bin/conda")
NO_CONTAINER = {"container": None, "container_binds": []}
GOLDENS = {
    "slurm-every-flag": ("slurm-gres", SLURM_OPTIONS, SOFTWARE.model_copy(update={**NO_CONTAINER, "python_env": VENV})),
    "slurm-container": ("slurm-container", SchedulerOptions(), SOFTWARE.model_copy(update={"python_env": VENV})),
    "pbs-every-flag": ("pbs-pals", PBS_OPTIONS, SOFTWARE.model_copy(update={**NO_CONTAINER, "python_env": CONDA})),
    "pbs-container": ("pbs-openmpi", SchedulerOptions(), SOFTWARE.model_copy(update={"python_env": CONDA})),
}


@pytest.mark.parametrize("name", GOLDENS)
def test_golden(name: str, tmp_path: Path) -> None:
    preset, options, software = GOLDENS[name]
    text = render(spec_with(preset, "torchrun", options, software), PRESETS[preset])
    golden_files.check_golden(GOLDEN / f"{name}.sh", text)
    bash_n(text, tmp_path)


def test_goldens_have_no_strays() -> None:
    assert sorted(path.stem for path in GOLDEN.glob("*.sh")) == sorted(GOLDENS)


def test_no_new_flag_changes_nothing() -> None:
    """A job without the new flags renders as before (the other goldens pin the full text)."""
    for name in PRESETS:
        plain = golden_spec(PRESETS[name], "torchrun")
        assert render(spec_with(name, "torchrun"), PRESETS[name]) == render(plain, PRESETS[name])


# --- precedence over the preset's directives ---------------------------------------------------------------


@pytest.mark.parametrize(("preset_line", "options", "expected"), [
    ("--mem=0", SchedulerOptions(mem="64G"), ["--mem=64G"]),
    ("--mem-per-cpu=4G", SchedulerOptions(mem="64G"), ["--mem=64G"]),  # sbatch: mutually exclusive
    ("-C v100", SchedulerOptions(constraint="a100"), ["--constraint=a100"]),
    ("--qos normal", SchedulerOptions(qos="high"), ["--qos=high"]),
    ("--mem=0", SchedulerOptions(directives=["--mem=8G"]), ["--mem=8G"]),  # a raw directive wins too
    ("-c 4", SchedulerOptions(cpus_per_task=2), ["--cpus-per-task=2"]),
])
def test_command_line_replaces_the_presets_slurm_directive(preset_line: str, options: SchedulerOptions,
                                                            expected: list[str]) -> None:
    preset = PRESETS["slurm-gres"].model_copy(update={"directives": [preset_line, "--exclusive"]})
    lines = directive_lines(render(spec_with("slurm-gres", "torchrun", options), preset), "#SBATCH")
    assert preset_line not in lines and "--exclusive" in lines
    for line in expected:
        assert lines.count(line) == 1, lines


def test_command_line_replaces_the_presets_pbs_directive() -> None:
    preset = PRESETS["pbs-pals"].model_copy(update={"directives": ["-m n", "-l job_priority=regular",
                                                                   "-l place=pack"]})
    options = SchedulerOptions(mail_type=["END"], directives=["-l job_priority=premium"])
    lines = directive_lines(render(spec_with("pbs-pals", "torchrun", options), preset), "#PBS")
    assert "-m n" not in lines and "-l job_priority=regular" not in lines
    assert {"-m e", "-l job_priority=premium", "-l place=pack"} <= set(lines)
    placed = directive_lines(render(spec_with("pbs-pals", "torchrun", SchedulerOptions(
        directives=["-l place=excl"])), PRESETS["pbs-pals"]), "#PBS")
    assert "-l place=scatter" not in placed and "-l place=excl" in placed  # the user's placement, not nodescale's


def test_option_keys() -> None:
    assert [slurm_key(line) for line in ["--mem=0", "--mem 0", "-w n1", "-wn1", "--mem-per-gpu=1G", "--exclusive"]] \
        == ["--mem", "--mem", "--nodelist", "--nodelist", "--mem", "--exclusive"]
    assert [pbs_key(line) for line in ["-l place=scatter", "-l walltime=1:00:00,mem=1gb", "-W depend=afterok:1",
                                       "-m abe", "-q R1"]] == ["-l place", "-l walltime", "-W depend", "-m", "-q"]


def test_a_flag_and_a_directive_setting_the_same_option_is_refused() -> None:
    options = SchedulerOptions(mem="8G", directives=["--mem=16G"])
    with pytest.raises(UserError, match="--directive '--mem=16G': sets --mem, which another flag"):
        render(spec_with("slurm-gres", "torchrun", options), PRESETS["slurm-gres"])


def test_cpus_per_task_overrides_directive_step_and_pbs_chunk() -> None:
    for mode in ("torchrun", "per-gpu", "spawn"):
        text = render(spec_with("slurm-gres", mode, SchedulerOptions(cpus_per_task=3)), PRESETS["slurm-gres"])
        assert re.findall(r"--cpus-per-task=(\d+)", text) == ["3", "3"], mode  # the directive and the srun line
    text = render(spec_with("pbs-pals", "per-gpu", SchedulerOptions(cpus_per_task=3)), PRESETS["pbs-pals"])
    assert "#PBS -l select=2:ncpus=12:ngpus=4:mpiprocs=4" in text  # 3 CPUs x 4 tasks per node


def test_pbs_nodelist_becomes_host_chunks() -> None:
    options = SchedulerOptions(nodelist=["dec[0001-0002]"], mem="16G")
    spec = spec_with("pbs-pals", "torchrun", options, nodes=3)
    assert "#PBS -l select=1:host=dec0001:ncpus=64:ngpus=4:mpiprocs=1:mem=16gb+1:host=dec0002:ncpus=64:ngpus=4:" \
           "mpiprocs=1:mem=16gb+1:ncpus=64:ngpus=4:mpiprocs=1:mem=16gb" in render(spec, PRESETS["pbs-pals"])


# --- refused: what PBS Pro lacks, and impossible combinations ----------------------------------------------


@pytest.mark.parametrize(("options", "update", "message"), [
    (SchedulerOptions(qos="high"), {}, "--qos high: PBS Pro has no quality of service"),
    (SchedulerOptions(exclude=["n1"]), {}, "--exclude n1: PBS Pro has no node exclusion"),
    (SchedulerOptions(constraint="a100"), {}, "--constraint a100: PBS Pro has no node features"),
    (SchedulerOptions(mem="0"), {}, "--mem 0: PBS Pro has no 'all of the node's memory' request"),
    (SchedulerOptions(mail_type=["TIME_LIMIT"]), {}, "PBS Pro mails at no TIME_LIMIT event"),
    (SchedulerOptions(mail_type=["ARRAY_TASKS"]), {}, "only with BEGIN, END or FAIL"),
    (SchedulerOptions(dependency="singleton"), {}, "PBS Pro has no singleton dependency"),
    (SchedulerOptions(dependency="afterok:1?afterany:2"), {}, r"PBS Pro has no '\?' \(any of the conditions\)"),
    (SchedulerOptions(dependency="aftercorr:12"), {}, "PBS Pro has no aftercorr"),
    (SchedulerOptions(reservation="R1"), {"queue": "main"}, "a PBS reservation is a queue of its own"),
    (SchedulerOptions(nodelist=["a,b,c"]), {}, "names 3 nodes and the job has 2"),
])
def test_pbs_refuses_what_it_cannot_ask_for(options: SchedulerOptions, update: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message) as error:
        render(spec_with("pbs-pals", "torchrun", options, **update), PRESETS["pbs-pals"])
    assert error.value.hint


@pytest.mark.parametrize(("options", "message"), [
    (SchedulerOptions(dependency="afterok:12.server"), "Slurm job ids are numbers"),
    (SchedulerOptions(nodelist=["n[1-3]"]), "names 3 nodes and the job has 2"),
    (SchedulerOptions(nodelist=["n1"], exclude=["n[1-2]"]), "--nodelist and --exclude n1: a node cannot be both"),
])
def test_slurm_refuses_impossible_options(options: SchedulerOptions, message: str) -> None:
    with pytest.raises(UserError, match=re.escape(message)):
        render(spec_with("slurm-gres", "torchrun", options), PRESETS["slurm-gres"])


def test_host_lists_expand() -> None:
    assert hosts(["node[01-03,7]", "gpu1"]) == ["node01", "node02", "node03", "node7", "gpu1"]
    assert SchedulerOptions(exclude=["a[1-2],b"]).exclude == ["a[1-2]", "b"]


# --- the flags, through the CLI --------------------------------------------------------------------------


def launch(*flags: str, scheduler: str = "slurm") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["launch", f"--scheduler={scheduler}", "--gpus-per-node=0", *flags, "--dry-run", "--", "true"])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(("flags", "message"), [
    (["--mem=16GB"], "--mem '16GB': must be a whole number with an optional unit K, M, G or T"),
    (["--mem=-1"], "--mem '-1': must be a whole number"),
    (["--constraint=a100 ib"], "--constraint 'a100 ib': must be feature names"),
    (["--exclude=node1;rm"], "--exclude 'node1;rm': must be node names"),
    (["--exclude=n[1-99999]"], "at most 4096 nodes"),
    (["--nodelist=a,,b"], "--nodelist 'a,,b': must be node names"),
    (["--qos=hi gh"], "--qos 'hi gh': must be letters"),
    (["--reservation=r$1"], "--reservation 'r$1': must be names"),
    (["--dependency=afterok"], "--dependency 'afterok': must be TYPE:JOBID"),
    (["--dependency=afterok:1,afterany:2?after:3"], "joined by ',' (all) or '?' (any)"),
    (["--dependency=aftr:1"], "TYPE one of after, afterany"),
    (["--mail-type=END,NEVER"], "--mail-type 'END,NEVER': must be one or more of NONE, BEGIN"),
    (["--mail-user=a b"], "--mail-user 'a b': must be a user name or an address"),
    (["--directive=#SBATCH --mem=1G"], "is written without the #SBATCH or #PBS prefix"),
    (["--directive=mem=1G"], "must be an option of sbatch or qsub"),
    (["--directive=--mem=1G\nrm -rf ~"], "must not contain newlines"),
    (["--cpus-per-task=0"], "--cpus-per-task 0: must be a whole number, at least 1"),
    (["--cpus-per-task=x"], "--cpus-per-task x: must be a whole number"),
    (["--module="], "--module '': must not be empty"),
    (["--setup=echo a\necho b"], "--setup 'echo a\\necho b': must not contain newlines"),
    (["--setup=if true"], "--setup 'if true': is not a line bash can read (line 2: syntax error"),
    (["--setup=;"], "--setup ';': is not a line bash can read (syntax error near unexpected token"),
    (["--container-bind=/a,/b", "--container=/i.sif"], "--container-bind '/a,/b': must be SRC[:DST] without commas"),
    (["--container-bind=/a"], "--container-bind /a: generic-slurm runs no container"),
])
def test_bad_flag_values_are_user_errors(flags: list[str], message: str) -> None:
    code, _, err = launch(*flags)
    assert code == 2 and message in err and "hint:" in err, err


@pytest.mark.parametrize(("flags", "message", "hint"), [
    (["--container-setup=echo hi"], "--container-setup 'echo hi': {preset} runs no container",
     "name the image with --container IMAGE"),
    (["--container=/i.sif", "--container-setup= "], "--container-setup ' ': must not be empty", "e.g. --container"),
    (["--container=/i.sif", "--container-setup=echo a\necho b"], "--container-setup 'echo a\\necho b': must not "
     "contain newlines", "e.g. --container-setup"),
    (["--container=/i.sif", "--container-setup=source venv/bin/activate &&"], "--container-setup 'source "
     "venv/bin/activate &&': is not a line bash can read", "e.g. --container-setup"),
])
@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
def test_container_setup_mistakes_are_one_line_errors(flags: list[str], message: str, hint: str,
                                                      scheduler: str) -> None:
    code, _, err = launch(*flags, scheduler=scheduler)
    said = [line for line in err.splitlines() if not line.startswith("nodescale: warning:")]
    assert code == 2 and len(said) == 2, err
    assert said[0].startswith(f"nodescale: error: {message.format(preset=f'generic-{scheduler}')}"), err
    assert said[1].startswith(f"  hint: {hint}"), err


@pytest.mark.parametrize("flag", ["--container=/i.sif", "--setup=echo hi", "--container-setup=echo hi"])
def test_software_flags_are_refused_for_a_local_run(flag: str) -> None:
    code, _, err = launch(flag, scheduler="local")
    name, _, value = flag.partition("=")
    assert code == 2 and f"{name} {shlex.quote(value)} with a local run: sets up a Slurm or PBS job script's " \
        "environment" in err, err


def test_flags_reach_the_script() -> None:
    code, out, _ = launch("--mem=2g", "--mail-type=end", "--directive=--exclusive", "--module=cuda/12",
                          "--setup=echo ready", "--cpus-per-task=2", "--container=/i.sif", "--container-bind=/data")
    assert code == 0
    for line in ["#SBATCH --mem=2G", "#SBATCH --mail-type=END", "#SBATCH --exclusive", "#SBATCH --cpus-per-task=2",
                 "module load cuda/12", "echo ready", "singularity exec --bind /data /i.sif \\"]:
        assert line in out.split("\n") or f"    {line}" in out.split("\n"), line


# --- the submitting Python environment -----------------------------------------------------------------------


def test_submitting_environment_is_found(tmp_path: Path) -> None:
    venv, conda = tmp_path / "venv", tmp_path / "conda"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")
    (venv / "pyvenv.cfg").write_text("")
    (conda / "conda-meta").mkdir(parents=True)
    assert submitting_python_env({}, str(venv), "/usr") == PythonEnv(kind="venv", prefix=str(venv))
    assert submitting_python_env({"CONDA_EXE": "/opt/conda/bin/conda"}, str(conda), "/usr") == PythonEnv(
        kind="conda", prefix=str(conda), conda_exe="/opt/conda/bin/conda")
    assert submitting_python_env({"VIRTUAL_ENV": str(venv)}, "/usr", "/usr") == PythonEnv(kind="venv",
                                                                                         prefix=str(venv))
    assert submitting_python_env({}, "/usr", "/usr") is None  # the system Python: nothing to activate


def test_activation_comes_after_the_modules_and_before_the_setup_lines() -> None:
    venv = Software(lines=[("module", "python/3.11"), ("setup", "echo setup")],
                    python_env=PythonEnv(kind="venv", prefix="/v e"))
    lines = render(spec_with("slurm-gres", "torchrun", software=venv), PRESETS["slurm-gres"]).split("\n")
    order = [lines.index(line) for line in ["module load pytorch/2.1", "module load python/3.11",
                                            "source '/v e/bin/activate'", "echo setup", "set -u"]]
    assert order == sorted(order)
    no_exe = venv.model_copy(update={"python_env": PythonEnv(kind="conda", prefix="/c")})
    text = render(spec_with("slurm-gres", "torchrun", software=no_exe), PRESETS["slurm-gres"])
    assert 'export CONDA_PREFIX=/c PATH=/c/bin:"$PATH"' in text
    contained = render(spec_with("slurm-container", "torchrun", software=venv), PRESETS["slurm-container"])
    assert "/v e/" not in contained  # in a container, the container's Python
    assert "# The submitting Python environment is not activated: the job's Python is the container's." in contained


# --- the software environment as typed ------------------------------------------------------------------------


@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
def test_module_and_setup_lines_run_in_the_order_typed(scheduler: str) -> None:
    """LUMI's `module use` must come before the `module load` it makes possible."""
    code, out, err = launch("--module=first", "--setup=module use /appl/local/containers/ai-modules",
                            "--module=singularity-userfilesystems", "--setup=echo last", scheduler=scheduler)
    assert code == 0, err
    assert [line for line in out.split("\n") if line.startswith(("module ", "echo last"))] == [
        "module load first", "module use /appl/local/containers/ai-modules", "module load singularity-userfilesystems",
        "echo last"]


def test_the_presets_software_comes_first_then_the_command_lines_as_typed() -> None:
    software = Software(lines=[("module", "cuda/12.2"), ("module", "early"), ("setup", "module use /x"),
                               ("module", "late"), ("module", "cuda/12.2")], python_env=CONDA)
    text = render(spec_with("pbs-pals", "torchrun", software=software), PRESETS["pbs-pals"])
    block = text.split("\nset +u\n", 1)[1].split("\nset -u\n", 1)[0].split("\n")
    assert [line for line in block if not line.startswith("#")] == [
        "module load conda", "module load cuda/12.2", "module load early",  # modules typed before any --setup
        f'eval "$({CONDA.conda_exe} shell.bash hook)"', f"conda activate {CONDA.prefix}",
        "conda activate /glade/work/user/envs/torch",  # the preset's setup
        "module use /x", "module load late", "module load cuda/12.2"]  # then as typed: after `module use`, loaded


@pytest.mark.parametrize("mode", ["torchrun", "spawn"])
@pytest.mark.parametrize(("preset", "image"), [("slurm-container", None), ("pbs-openmpi", "/i.sif")])
def test_container_setup_lines_run_inside_the_container_after_the_presets(preset: str, image: str | None, mode: str,
                                                                        tmp_path: Path) -> None:
    software = Software(container=image, container_setup=["echo inside", "cd /work"])
    text = render(spec_with(preset, mode, software=software), PRESETS[preset])
    words, _, after = text[text.index("singularity exec"):].partition("\n")
    assert words.endswith(" \\") and after.lstrip().startswith("bash -c '\n"), after
    script = after.split("bash -c '\n", 1)[1].split("\n")
    container = PRESETS[preset].container
    expected = ["set -e", *(container.setup if container else []), "echo inside", "cd /work"]
    assert [line.strip() for line in script[:len(expected)]] == expected
    bash_n(text, tmp_path)


def test_a_submitting_venv_is_detected_by_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.prefix", str(tmp_path))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "activate").write_text("")
    (tmp_path / "pyvenv.cfg").write_text("")
    code, out, _ = launch()
    assert code == 0 and f"source {tmp_path}/bin/activate" in out.split("\n"), out
