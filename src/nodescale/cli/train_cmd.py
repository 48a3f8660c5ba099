"""``nodescale train``: validate, pick how processes start, train."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from nodescale.cli.run_flags import add_run_flags, resolve_config
from nodescale.config.combinations import check_tensor_parallel_model
from nodescale.config.schema import RunConfig
from nodescale.config.strategy import check_tensor_parallel_world


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a model (default: cnn on the digits dataset, DDP on 2 local processes)",
        description="Train a built-in model on a built-in dataset, or your own (--model FILE.py:FUNCTION, "
        "--dataset FILE.py:FUNCTION, --loss FILE.py:FUNCTION). Runs unchanged under torchrun, srun or "
        "mpiexec; on its own, --nproc starts the local processes.",
    )
    add_run_flags(parser)
    parser.set_defaults(handler=run)


def local_process_count(cfg: RunConfig) -> int:
    """How many local processes ``--nproc`` means: auto is one per GPU, or 2 on CPU (DDP, FSDP, DeepSpeed)."""
    if not cfg.strategy.multi_process:
        return 1
    if cfg.strategy.nproc != "auto":
        return int(cfg.strategy.nproc)
    from nodescale.distributed.accelerators import default_local_processes

    return default_local_processes()


def run(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    from nodescale.distributed.env import detect

    env = detect()
    _warn_if_srun_forgotten(env.source)
    if env.source != "single":  # started by torchrun, srun, mpiexec...: we are one of the workers
        if cfg.strategy.nproc != "auto" and env.rank == 0:
            warnings.warn(f"--nproc ignored: {env.source} started {env.world_size} processes", stacklevel=1)
        if env.rank == 0:
            _warn_about_restarts_under_a_launcher(cfg, env.source)
        from nodescale.train.run import run_training_as_worker

        run_training_as_worker(cfg, env)
        return 0
    return _run_here(cfg)


def _warn_if_srun_forgotten(source: str) -> None:
    import os

    tasks = os.environ.get("SLURM_NTASKS", "1")
    if source == "single" and tasks.isdigit() and int(tasks) > 1:
        warnings.warn(
            f"this Slurm job asked for {tasks} tasks but nodescale was started once, outside srun; "
            "start it with `srun nodescale train ...` (one task per GPU) or it uses --nproc local processes only",
            stacklevel=2,
        )


def _warn_about_restarts_under_a_launcher(cfg: RunConfig, source: str) -> None:
    """Restarts belong to whoever started the processes; say what nodescale's flag does not do there."""
    import os

    from nodescale.launch.schedulers.local_launcher import current_restart

    if cfg.checkpoint.max_restarts:
        warnings.warn(f"--max-restarts ignored: {source} started the processes, so it restarts them "
                      "(nodescale launch --max-restarts N, or torchrun --max-restarts N; nodescale resumes "
                      "restarted workers from the newest checkpoint)",
                      stacklevel=2)
    # torchrun's agent, or a job script's restart loop (nodescale launch --max-restarts).
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    restarts = os.environ.get("NODESCALE_MAX_RESTARTS", "0") if restarts == "0" else restarts
    if cfg.out is None and current_restart() is None and restarts.isdigit() and int(restarts) > 0:
        warnings.warn("the launcher may restart the workers, but without --out each attempt starts a new run "
                      "directory and cannot resume from the last one's checkpoints: pass --out DIR", stacklevel=2)


def _run_here(cfg: RunConfig) -> int:
    from nodescale.atomic_files import write_text_atomic
    from nodescale.config.load import dump_yaml
    from nodescale.data.registry import get_format
    from nodescale.engine.run_dir import check_run_dir, held_for_workers
    from nodescale.train.rundir import default_run_dir

    # Everything that can be checked without processes is checked here, so a
    # typo costs a second, not a job start-up.
    get_format(cfg.data.name).check(cfg.data)
    cfg = cfg.model_copy(update={"out": cfg.out or default_run_dir(cfg)})
    assert cfg.out is not None
    check_run_dir(cfg.out, cfg.checkpoint.resume)
    nproc = local_process_count(cfg)
    check_tensor_parallel_world(cfg.strategy, nproc)
    check_tensor_parallel_model(cfg)
    if cfg.strategy.name == "deepspeed":
        _check_deepspeed_config(cfg, nproc)
    _check_offload_has_an_accelerator(cfg)
    if cfg.strategy.multi_process:
        from nodescale.distributed.accelerators import check_backend

        check_backend(cfg.strategy.backend, "--backend",
                      "leave --backend at auto (nccl on CUDA devices, gloo elsewhere), or use --backend gloo")
    restarts = cfg.checkpoint.max_restarts
    if nproc == 1 and not restarts:  # restarts need a process to restart: one worker under the launcher
        from nodescale.train.run import run_training

        run_training(cfg)
        return 0
    import tempfile

    from nodescale.launch.schedulers.local_launcher import launch_local
    from nodescale.launch.schedulers.temp_files import remove_at_exit

    # The workers' copy of the configuration; rank 0 writes the run's config.yaml itself
    # once training is sure to start (a refused --resume must not overwrite it). The launcher
    # holds the run directory across restarts, and its ranks.log goes there.
    with tempfile.TemporaryDirectory(prefix="nodescale-launch-") as handoff, \
            held_for_workers(Path(cfg.out), cfg.checkpoint.resume):
        remove_at_exit(handoff)  # also when this launcher is killed outright
        config_path = Path(handoff) / "config.yaml"
        write_text_atomic(config_path, dump_yaml(cfg))
        sys.stdout.flush()
        code = launch_local([sys.executable, "-u", "-m", "nodescale.train.worker", str(config_path)], nproc,
                            max_restarts=restarts, preload=_preload(cfg), log_dir=Path(cfg.out))
    if code == 1:
        # A failure that was not the user's: the checkpoints so far are still good.
        tried = f"after {restarts} restart{'s' if restarts != 1 else ''}" if restarts else "with --max-restarts 0"
        print(f"nodescale: training stopped {tried}; continue with `nodescale train --out {cfg.out} --resume` "
              "(and the same settings), or pass --max-restarts N to restart automatically", file=sys.stderr)
    return code


def _preload(cfg: RunConfig) -> tuple[str, ...]:
    """What every worker imports before its first step: imported once, and the workers forked from it."""
    modules = ("nodescale.train.run", "torch._dynamo")  # torch._dynamo: imported by the first optimizer
    if cfg.strategy.name == "deepspeed":
        modules += ("deepspeed",)
    if cfg.model.name.startswith("hf:"):
        modules += ("transformers",)
    return modules


def _check_deepspeed_config(cfg: RunConfig, world_size: int) -> None:
    """The DeepSpeed config's batch arithmetic and precision, before any process starts."""
    from nodescale.strategies.deepspeed_config import config_for_run

    config_for_run(cfg, world_size, has_batchnorm=False)


def _check_offload_has_an_accelerator(cfg: RunConfig) -> None:
    offload = getattr(cfg.strategy, "cpu_offload", "none")
    if offload == "none":  # the check imports torch (nodescale.strategies): only when it matters
        return
    from nodescale.distributed.accelerators import visible_gpus
    from nodescale.strategies.offload import refuse_offload_without_accelerator

    refuse_offload_without_accelerator(offload, visible_gpus() > 0)
