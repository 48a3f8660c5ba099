"""``nodescale bench scaling --nodes 1,2,4 --cluster C``: one Slurm or PBS job per node count.

Each job is built by launch's own :func:`~nodescale.cli.launch_cmd.build_spec` from launch flags and
submitted through its scheduler (dry run, then queue), so a study job is exactly the job ``nodescale
launch --nodes N ... -- nodescale train ...`` would submit. With ``--sequential`` each job waits for
the one before (``afterany``: a failed size does not stop the next). ``STUDY/study.json`` records them
(:mod:`nodescale.bench.scaling_study`); each job runs ``--collect STUDY`` once its step has ended
(:mod:`nodescale.launch.after_step`), and ``--collect STUDY`` and ``nodescale report STUDY`` read it again.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nodescale.errors import UserError

# bench scaling flag -> launch flag, passed on when given.
LAUNCH_FLAGS = ("--cluster", "--scheduler", "--account", "--time", "--queue", "--gpus-per-node", "--job-dir")


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("across node counts (one Slurm or PBS job per count, as nodescale launch "
                                      "submits it)")
    group.add_argument("--nodes", metavar="LIST", help="node counts, e.g. 1,2,4: one job each, training into "
                       "OUT/nodes-N (needs --cluster or --scheduler)")
    group.add_argument("--sequential", action="store_true", help="each job starts after the one before ends "
                       "(afterany), so the sizes never share the cluster")
    group.add_argument("--cluster", metavar="PRESET", help="cluster preset (see `nodescale clusters`)")
    group.add_argument("--scheduler", help="slurm or pbs (default: the preset's)")
    group.add_argument("--account", help="account / project to charge")
    group.add_argument("--time", help="wall time of each job, HH:MM:SS (default: launch's)")
    group.add_argument("--queue", help="partition (Slurm) or queue (PBS)")
    group.add_argument("--gpus-per-node", metavar="G", help="GPUs per node (default: the preset's); processes per "
                       "node = G, or 1 without GPUs")
    group.add_argument("--job-dir", metavar="DIR", help="where scripts and logs go (default: launch's)")


def wanted(args: argparse.Namespace) -> bool:
    return args.nodes is not None or args.sequential or any(_given(args, flag) for flag in LAUNCH_FLAGS)


def _given(args: argparse.Namespace, flag: str) -> Any:
    return getattr(args, flag[2:].replace("-", "_"))


def check_flags(args: argparse.Namespace) -> list[int]:
    """The node counts, once the flags make a study; UserError for a combination that does not."""
    from nodescale.bench.scaling_study import parse_nodes

    if args.nodes is None:
        flag = "--sequential" if args.sequential else next(flag for flag in LAUNCH_FLAGS if _given(args, flag))
        raise UserError(f"{flag} without --nodes", "belongs to a study across node counts (one job per count)",
                        "add --nodes 1,2,4 (and --cluster C), or drop it to scale over processes on this machine")
    if args.world_sizes is not None:
        raise UserError("--nodes with --world-sizes", "a study's world sizes are its node counts x processes per node",
                        "give one: --nodes for cluster jobs, --world-sizes for processes on this machine")
    if not (args.cluster or args.scheduler):
        raise UserError("--nodes without --cluster or --scheduler", "each node count is a Slurm or PBS job",
                        "add --cluster PRESET (see `nodescale clusters`) or --scheduler slurm|pbs")
    return parse_nodes(args.nodes)


def launch_argv(args: argparse.Namespace) -> list[str]:
    """The launch flags given to bench scaling, as ``nodescale launch`` takes them."""
    argv = []
    for flag in LAUNCH_FLAGS:
        if _given(args, flag) is not None:
            argv += [flag, str(_given(args, flag))]
    return argv


def build_job(flags: list[str], nodes: int, command: list[str], dependency: str | None = None,
              gather: list[str] | None = None) -> tuple[Any, Any]:
    """The ``JobSpec`` and ``Preset`` of one node count, from launch's own parser and ``build_spec``; ``gather``
    runs in the job once its step has ended (the study's collect)."""
    from nodescale.cli.launch_cmd import build_spec
    from nodescale.cli.main import build_parser

    after = ["--dependency", dependency] if dependency else []
    args = build_parser().parse_args(["launch", *flags, *after, "--nodes", str(nodes),
                                      "--job-name", f"scaling-{nodes}n", "--", *command])
    spec, preset = build_spec(args)
    if spec.scheduler == "local":
        raise UserError("--scheduler local with --nodes", "a study submits one Slurm or PBS job per node count",
                        "use --scheduler slurm|pbs or a --cluster preset; --world-sizes scales on this machine")
    return (spec.model_copy(update={"after_step": gather}) if gather else spec), preset


def run(args: argparse.Namespace, train_args: tuple[str, ...], check_plan: Callable[[Any], None]) -> int:
    """Check the study, then print its dry run or submit its jobs."""
    from nodescale.bench import scaling_study
    from nodescale.bench.scaling import ScalingPlan
    from nodescale.launch.schedulers.table import BATCH

    counts = check_flags(args)
    out = args.out.resolve()
    flags = launch_argv(args)
    nproc = build_job(flags, counts[0], ["nodescale", "train"])[0].nproc_per_node
    plan = ScalingPlan(out, tuple(n * nproc for n in counts), args.mode or "strong", args.batch_size,
                       args.max_steps, args.warmup_steps, train_args)
    check_plan(plan)
    study = scaling_study.Study(out, "", plan.mode, plan.batch_size, plan.max_steps, plan.warmup_steps, nproc,
                                args.sequential, list(train_args), flags)
    study.jobs = [scaling_study.StudyJob(n, n * nproc, str(scaling_study.run_dir(out, n))) for n in counts]

    def command(job: Any) -> list[str]:
        return ["nodescale", *plan.train_argv(job.world_size, Path(job.run_dir))]

    # Each job gathers the study's results as it ends: --collect, which rereads every finished size.
    peak = [] if args.peak_dtype == "auto" else ["--peak-dtype", args.peak_dtype]
    gather = ["nodescale", "bench", "scaling", "--collect", str(out), *peak]
    built = [build_job(flags, job.nodes, command(job), gather=gather) for job in study.jobs]
    scheduler = BATCH[built[0][0].scheduler]
    study.scheduler = scheduler.name
    dryruns = [scheduler.dryrun(spec, preset) for spec, preset in built]  # every size checked before any is queued
    if args.dry_run:
        print_table(study)
        print(dryruns[0].show(), end="")
        return 0
    if scaling_study.is_study(out) or any(Path(job.run_dir).exists() for job in study.jobs):
        raise UserError(f"--out {str(args.out)!r}", "already holds a scaling study",
                        f"choose another --out, or read it again: nodescale bench scaling --collect {args.out}")
    out.mkdir(parents=True, exist_ok=True)
    scaling_study.write(study)
    previous = None
    for job, dryrun in zip(study.jobs, dryruns, strict=True):
        dependency = f"afterany:{previous}" if args.sequential and previous else None
        if dependency:
            dryrun = scheduler.dryrun(*build_job(flags, job.nodes, command(job), dependency, gather))
        queued = scheduler.queue(dryrun)
        job.job_id, job.script, job.log = queued.job_id, queued.script, queued.log
        scaling_study.write(study)
        print(f"submitted {scheduler.name} job {job.job_id}: {job.nodes} node(s), world size {job.world_size}"
              f"{f' (after {previous})' if dependency else ''}\n  log: {job.log}", flush=True)
        previous = job.job_id
    print(f"each job gathers the results into {args.out}/scaling.json as it ends; nodescale report {args.out} "
          f"(or nodescale bench scaling --collect {args.out}) gathers them again")
    return 0


def print_table(study: Any) -> None:
    """The jobs a study submits: node count, processes, batch, dependency, run directory."""
    from nodescale.bench import scaling_math

    chained = "sequential: each job after the one before (afterany)" if study.sequential else "all at once"
    print(f"# scaling study, {study.mode} scaling, {len(study.jobs)} {study.scheduler} jobs, {chained}")
    print(f"# {'nodes':>5}  {'processes':>9}  {'batch/process':>13}  {'after':>10}  run directory")
    for index, job in enumerate(study.jobs):
        batch = scaling_math.per_process_batch(study.batch_size, job.world_size, study.mode)
        after = f"{study.jobs[index - 1].nodes} node(s)" if study.sequential and index else "-"
        print(f"# {job.nodes:>5}  {job.world_size:>9}  {batch:>13}  {after:>10}  {job.run_dir}")
    print("# the first job's script:")
