"""``--checkpoint-stage DIR``: save to node-local disk, then copy to the run directory in the background.

The save writes the files and manifest it would write to the run directory, but under DIR
(fast local disk): the stall is that of a local write. A thread of ``BackgroundSaves`` (the
mechanism of ``--checkpoint-async``, one save in flight) then copies the checkpoint into the
run directory, every file synced, and deletes the staged copy. The run directory's checkpoint
becomes visible only whole: a file is renamed into place and its manifest copied after it; a
directory is filled as ``step-N.partial``, manifest last, and renamed. A job killed mid-copy
leaves a temporary file or a ``.partial`` that resume never takes. The run's end and a requeue
exit wait for the copy, as for any background save.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

from nodescale.atomic_files import write_atomic
from nodescale.engine import checkpoint_files, manifest
from nodescale.errors import UserError


def staged_run_dir(stage: Path, run_dir: Path) -> Path:
    """Where a run's checkpoints are staged: one folder per run directory, so runs sharing a node's disk never meet."""
    digest = hashlib.sha256(str(run_dir.absolute()).encode()).hexdigest()[:10]
    return stage / f"{run_dir.name}-{digest}"


def check_one_node(num_nodes: int, sharded: bool, stage: Path) -> None:
    """A sharded checkpoint is one directory every rank writes into: on several nodes, each node's local
    disk would hold only its own ranks' shards."""
    if sharded and num_nodes > 1:
        raise UserError(f"--checkpoint-stage {stage} with a sharded checkpoint on {num_nodes} nodes",
                        "every rank writes its shards into one directory, which a node-local disk is not",
                        "use --checkpoint-format full (rank 0 writes one file), or drop --checkpoint-stage")


def copier(run_dir: Path, keep_last: int, is_main: bool, agree: Callable[[BaseException | None, int], None],
           reported: Callable[[BaseException, int], BaseException]) -> Callable[[int, Path], Path]:
    """What ``BackgroundSaves`` runs after a staged save, on every rank: rank 0 copies checkpoint ``step`` from
    its staged path into ``run_dir``; then every rank learns whether it worked (``agree``), so all stop together.
    ``reported``: a copy that ran out of space as the plain full-disk error."""
    def copy(step: int, staged: Path) -> Path:
        error = None
        if is_main:
            try:
                copy_checkpoint(staged, run_dir, step, keep_last)
            except BaseException as caught:  # raised on the training thread by BackgroundSaves.wait
                error = reported(caught, step)
        agree(error, step)
        return run_dir_path(staged, run_dir)

    return copy


def run_dir_path(staged: Path, run_dir: Path) -> Path:
    """The path in ``run_dir`` of the staged checkpoint ``staged``."""
    return checkpoint_files.checkpoint_dir(run_dir) / staged.name


def copy_checkpoint(staged: Path, run_dir: Path, step: int, keep_last: int) -> Path:
    """Rank 0: the staged checkpoint of ``step`` into ``run_dir``, durable before it is visible; then the staged
    copy is deleted (local disks are small) and the run directory pruned to ``keep_last``."""
    target = run_dir_path(staged, run_dir)
    if checkpoint_files.is_sharded(staged):
        partial = checkpoint_files.partial_dir(run_dir, step)
        shutil.rmtree(partial, ignore_errors=True)  # left by a copy that was killed
        names = [str(f.relative_to(staged)) for f in sorted(staged.rglob("*")) if f.is_file()]
        names.sort(key=lambda name: name == manifest.DIRECTORY_MANIFEST)  # the manifest last
        for name in names:
            _copy_file(staged / name, partial / name)
        checkpoint_files.publish_sharded(run_dir, step, keep_last)
        shutil.rmtree(staged, ignore_errors=True)
        return target
    staged_manifest = staged.with_suffix(".manifest.json")
    target.with_suffix(".manifest.json").unlink(missing_ok=True)  # a same-step save of a resumed run
    _copy_file(staged, target)
    _copy_file(staged_manifest, target.with_suffix(".manifest.json"))
    checkpoint_files.prune(run_dir, keep_last)
    staged_manifest.unlink(missing_ok=True)
    staged.unlink(missing_ok=True)
    return target


def _copy_file(source: Path, target: Path) -> None:
    with open(source, "rb") as handle:
        write_atomic(target, lambda out: shutil.copyfileobj(handle, out, 16 << 20))  # synced, then renamed
