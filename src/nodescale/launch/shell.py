"""The batch script's own text, shared by both job-script renderers: quoting, checks and blocks.

Everything a user typed (job name, paths, account, queue, ``--env`` values, command words)
reaches a script only through :func:`quote` / :func:`join`, or, for scheduler directives,
through a check that it can be written there at all: ``#SBATCH`` and ``#PBS`` lines are read
by the scheduler with its own rules, not the shell's, and a newline in one would end the
directive and turn the rest of the value into shell code.

The blocks here run in the batch shell before the launch: header, prologue (environment,
modules, setup) and the rendezvous lookup. How the launch then starts the job's processes on
the nodes is :mod:`nodescale.launch.startup`.

Lines a preset author wrote (``setup``, ``directives``) are trusted shell and are written
verbatim.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Collection, Iterable, Mapping, Sequence

from nodescale.distributed import cpu_binding
from nodescale.distributed.env import DEFAULT_PORT, JOB_PORT_BASE, JOB_PORT_SPAN
from nodescale.errors import UserError
from nodescale.launch.job_options import PythonEnv
from nodescale.launch.spec import JobSpec, Preset

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_JOB_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.+-]")

# Left in the job by the submitting shell (sbatch copies its environment by default), these
# would tell every process it is rank N of M of some earlier run; torchrun and the per-task
# block set them afresh, and MASTER_ADDR/MASTER_PORT are derived below.
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
)

INDENT = "    "


class Expansion(str):
    """A word nodescale itself writes for the shell to expand at run time (``"$PBS_NODEFILE"``).

    Never built from user input: every user string goes through :func:`quote`.
    """


def quote(value: str) -> str:
    """``value`` as one shell word that the shell takes literally (an ``Expansion`` as written)."""
    return str(value) if isinstance(value, Expansion) else shlex.quote(value)


def join(words: Iterable[str]) -> str:
    """``words`` as shell words, each taken literally (``Expansion`` words as written)."""
    return " ".join(quote(word) for word in words)


def check_line(text: str, what: str) -> str:
    """``text`` unchanged, or :class:`UserError` if it holds a newline or another control character.

    For text that must stay on one line of the script: directives and comments.
    """
    if _CONTROL.search(text):
        raise UserError(f"{what} {text!r}", "must not contain newlines or other control characters")
    return text


def check_env_name(name: str) -> str:
    """``name`` unchanged, or :class:`UserError` if it is not a shell variable name."""
    if not _ENV_NAME.match(name):
        raise UserError(
            f"environment variable name {name!r}",
            "must be letters, digits and underscores, not starting with a digit",
        )
    return name


def check_absolute(path: object, what: str) -> str:
    """``path`` as text, or ValueError if relative: the job runs elsewhere, from another directory."""
    text = str(path)
    if not text.startswith("/"):
        raise ValueError(f"{what} must be an absolute path, got {text!r}")
    return text


def safe_job_name(name: str, *, limit: int | None = None) -> str:
    """``name`` with every character but letters, digits and ``_.+-`` replaced by ``_``.

    Job names end up in directives, ``squeue``/``qstat`` columns and log file names; PBS
    refuses whitespace in them. Replacing is friendlier than refusing: the name is a label.
    """
    safe = _JOB_NAME_UNSAFE.sub("_", name) or "nodescale"
    return safe[:limit] if limit else safe


def merged_env(preset_env: Mapping[str, str], user_env: Mapping[str, str]) -> dict[str, str]:
    """The job's environment: the preset's, then the user's, which wins on a shared name."""
    for name in (*preset_env, *user_env):
        check_env_name(name)
    return {**preset_env, **user_env}


def export_lines(env: Mapping[str, str]) -> list[str]:
    """One ``export NAME=VALUE`` line per variable, the value quoted."""
    return [f"export {check_env_name(name)}={quote(value)}" for name, value in env.items()]


def env_block(preset_env: Mapping[str, str], user_env: Mapping[str, str]) -> list[str]:
    """The export lines of the preset's and the user's variables, each group under a comment.

    A preset variable the user overrides is left out rather than exported twice.
    """
    merged_env(preset_env, user_env)  # checks every name
    lines: list[str] = []
    preset_only = {name: value for name, value in preset_env.items() if name not in user_env}
    if preset_only:
        lines += ["# Environment of the cluster preset.", *export_lines(preset_only)]
    if user_env:
        lines += ["# Environment from --env (wins over the preset's).", *export_lines(user_env)]
    return lines


def unset_block() -> list[str]:
    """Lines that clear launcher variables a submitting shell may have left in the job."""
    return [
        "# Launcher variables the submitting shell passed on (sbatch, qsub -V) would give every process a wrong rank.",
        "unset " + " ".join(LAUNCHER_VARIABLES),
    ]


def setup_block(modules: Sequence[str], setup: Sequence[str], activate: Sequence[str] = (),
                whose: str = "The preset's") -> list[str]:
    """``module load`` lines, the ``activate`` lines, then the setup lines verbatim, with ``set -u`` off.

    Module and conda activation scripts read variables that may be unset; ``-u`` would abort
    them half way.
    """
    if not modules and not setup and not activate:
        return []
    lines = [f"# {whose} software environment; -u is off: module and activation scripts read unset variables.",
             "set +u"]
    lines += [module_load(module) for module in modules]
    lines += [*activate, *setup]
    lines.append("set -u")
    return lines


def module_load(module: str) -> str:
    """The line that loads ``module``."""
    return f"module load {quote(module)}"


def software_block(spec: JobSpec, preset: Preset) -> list[str]:
    """The preset's modules and setup, the command line's added, and the submitting environment's activation.

    The command line's ``--module`` names typed before its first ``--setup`` line load with the preset's
    modules, before the activation (which must follow module loads that could put another python first);
    from that line on, its lines run in the order typed, after the preset's setup: ``--setup 'module use DIR'
    --module M`` loads M from DIR.
    """
    added = spec.software.lines
    first_setup = next((i for i, (kind, _) in enumerate(added) if kind == "setup"), len(added))
    modules = [name for _, name in added[:first_setup]]
    in_order = [module_load(text) if kind == "module" else text for kind, text in added[first_setup:]]
    whose = "The preset's and the command line's" if added else "The preset's"
    activate = activate_lines(spec.software.python_env, preset.container is not None)
    # A module the preset loads is loaded once.
    return setup_block(list(dict.fromkeys([*preset.modules, *modules])), [*preset.setup, *in_order], activate, whose)


def activate_lines(python_env: PythonEnv | None, container: bool) -> list[str]:
    """Lines that activate the submitting venv or conda environment (nothing in a container, which has its own)."""
    if python_env is None:
        return []
    if container:
        return ["# The submitting Python environment is not activated: the job's Python is the container's."]
    lines = ["# The submitting Python environment, after the modules: sbatch copies PATH, but that is not activation,",
             "# and a module load can put another python first (qsub copies nothing)."]
    prefix = check_line(python_env.prefix, "Python environment")
    if python_env.kind == "venv":
        return [*lines, f"source {quote(prefix + '/bin/activate')}"]
    if python_env.conda_exe:
        hook = f"{quote(check_line(python_env.conda_exe, 'conda program'))} shell.bash hook"
        return [*lines, f'eval "$({hook})"', f"conda activate {quote(prefix)}"]
    return [*lines, f'export CONDA_PREFIX={quote(prefix)} PATH={quote(prefix + "/bin")}:"$PATH"']


# The first IPv4 address of a host name (IPv4: NCCL and gloo socket setups on clusters expect it).
IPV4_PROGRAM = "import socket, sys; print(socket.getaddrinfo(sys.argv[1], None, socket.AF_INET)[0][4][0])"


def port_program() -> str:
    """Python that prints the rendezvous port of the job id in ``sys.argv[1]``, as ``port_for_job`` does.

    Every node computes the same port from the same id, and two jobs sharing a node get
    different ports instead of both taking 29500 (:func:`nodescale.distributed.env.port_for_job`).
    """
    return (r'import re, sys, zlib; j = sys.argv[1].strip(); m = re.match(r"(\d+)(?:\[(\d*)\])?", j); '
            f"print({DEFAULT_PORT} if not j else {JOB_PORT_BASE} + "
            f"(int(m[1]) + int(m[2] or 0) if m else zlib.crc32(j.encode())) % {JOB_PORT_SPAN})")


def master_addr_line() -> str:
    """MASTER_ADDR from ``$head_addr``: its IPv4 address, or the name as it is where it does not resolve."""
    return f'MASTER_ADDR=$(python3 -c {quote(IPV4_PROGRAM)} "$head_addr" 2>/dev/null) || MASTER_ADDR=$head_addr'


def rendezvous_block(
    head_lines: Sequence[str], job_id_var: str, given: Collection[str], why_head: Sequence[str]
) -> list[str]:
    """Lines that set and export MASTER_ADDR and MASTER_PORT at run time, and log them.

    ``head_lines`` must set ``head_node`` (a name) and ``head_addr`` (its address or name);
    ``job_id_var`` names the scheduler's job id variable; ``why_head`` comments on where the
    head comes from. A variable in ``given`` (set with ``--env`` or by the preset) is kept.
    """
    lines = [
        "# Rendezvous: the allocation's first node hosts the c10d store, looked up here as the job runs;",
        "# the port derives from the job id: the same on every node, another for each job.",
        *why_head,
    ]
    if "MASTER_ADDR" in given:
        lines.append("# MASTER_ADDR is set explicitly above; kept.")
    else:
        lines += [*head_lines, master_addr_line()]
    if "MASTER_PORT" in given:
        lines.append("# MASTER_PORT is set explicitly above; kept.")
    else:
        lines.append(f'MASTER_PORT=$(python3 -c {quote(port_program())} "${job_id_var}")')
    lines += [
        "export MASTER_ADDR MASTER_PORT",
        'echo "nodescale: rendezvous at $MASTER_ADDR:$MASTER_PORT"',
    ]
    return lines


def check_renderable(spec: JobSpec, preset: Preset) -> None:
    """ValueError for what the caller should have refused before asking for a script, and
    :class:`UserError` for a command that starts with an option.

    The job's arithmetic (spawn mode on several nodes among it) is :func:`nodescale.launch.checks.check_job`'s,
    which every scheduler's dry run calls before rendering."""
    if spec.scheduler != preset.scheduler:
        raise ValueError(f"a {spec.scheduler} job cannot use the {preset.scheduler} preset {preset.name!r}")
    if spec.command[0].startswith("-"):
        # srun/mpiexec would read it as one of their own options.
        raise UserError(f"command {spec.command[0]!r}", "must start with a program, not an option")
    check_absolute(spec.workdir, "workdir")
    check_absolute(spec.job_dir, "job_dir")


def header_lines(spec: JobSpec, preset: Preset) -> list[str]:
    """The comment under the shebang: what the script runs, and why the directives come first."""
    name = check_line(preset.name, "preset name")
    return [
        f"# Job script written by `nodescale launch` for preset {name}: {spec.nodes} node(s) x "
        f"{spec.nproc_per_node} process(es), mode {spec.mode}.",
        "# Directives come first: the scheduler reads them only up to the first command.",
    ]


def prologue_lines(spec: JobSpec, preset: Preset, cd_comment: Sequence[str]) -> list[str]:
    """Strict mode, ``cd``, stale launcher variables cleared, modules/setup, exports."""
    blocks = [
        ["set -euo pipefail"],
        [*cd_comment, f"cd {quote(str(spec.workdir))}"],
        unset_block(),
        software_block(spec, preset),
        env_block({**preset.env, **worker_binding_env(spec, preset)}, spec.env),
    ]
    return paragraphs(blocks)


def worker_binding_env(spec: JobSpec, preset: Preset) -> dict[str, str]:
    """torchrun mode: the preset's per-task CPU list (srun binds one task per node), for each worker to apply."""
    bind = preset.cpu_bind
    if spec.mode == "torchrun" and bind and bind.startswith(cpu_binding.PER_TASK_BINDINGS):
        return {cpu_binding.VARIABLE: bind}
    return {}


def paragraphs(blocks: Iterable[Sequence[str]]) -> list[str]:
    """The non-empty ``blocks`` one after another, a blank line between two."""
    lines: list[str] = []
    for block in blocks:
        if block:
            lines += [*([""] if lines else []), *block]
    return lines
