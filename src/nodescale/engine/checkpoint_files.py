"""Checkpoints of the whole training state, in one of two layouts.

A checkpoint holds the model, optimiser, scheduler and gradient-scaler states,
where training stands (epoch, step within it, samples seen) and every rank's
random-number state, so that a resumed run ends with the same weights as an
uninterrupted one.

* full: ``checkpoints/step-NNNNNNNN.pt``, one file that global rank 0 writes
  after gathering the whole state (DDP's default; the most portable).
* sharded: ``checkpoints/step-NNNNNNNN/``, a directory every rank writes its
  shards into (the strategy's ``save_sharded``: torch.distributed.checkpoint, or
  DeepSpeed's own files), with ``trainer.pt`` (everything but model and
  optimiser) beside them. It must be on a file system every node sees.

Both are atomic: a file is renamed into place, a directory is written as
``step-NNNNNNNN.partial`` and renamed when every rank has finished. Each has a
manifest, ``step-NNNNNNNN.manifest.json`` beside a file, with every file's size and
SHA-256 (:mod:`nodescale.engine.manifest`); a directory has its own inside,
``manifest.json``, so it travels with the directory. The newest ``keep_last`` are kept;
resuming checks the manifest, skips a checkpoint that is damaged, incomplete or
does not load, and takes the one before.
"""

from __future__ import annotations

import random
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nodescale.atomic_files import in_the_way, make_directory, write_atomic
from nodescale.engine import manifest
from nodescale.errors import UserError

FORMAT = "nodescale-checkpoint/1"
TRAINER_FILE = "trainer.pt"  # inside a sharded checkpoint directory
_NAME = re.compile(r"^step-(\d{8,})(\.pt)?$")


def is_sharded_format(fmt: str, shards_state: bool) -> bool:
    """Whether ``checkpoint.format`` means every rank writes its shards (``auto``: where the strategy shards)."""
    return fmt == "sharded" or (fmt == "auto" and shards_state)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random-number states (torch, Python, and the GPU's), as checkpoints keep them."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Put back what :func:`rng_state` gave."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:08d}.pt"


def sharded_checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:08d}"


def is_sharded(path: Path) -> bool:
    return path.is_dir()


def _manifest_of(path: Path) -> Path:
    """A directory's manifest is inside it; a file's is beside it."""
    return path / manifest.DIRECTORY_MANIFEST if is_sharded(path) else path.with_suffix(".manifest.json")


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint (file or sharded directory) in the run, oldest first."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        # A directory counts only with its trainer state: the rename makes both appear together.
        if match and (path.is_file() if match.group(2) else (path / TRAINER_FILE).is_file()):
            found.append((int(match.group(1)), path))
    return sorted(found)


def save(run_dir: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write ``state`` as the checkpoint file of ``step``, then its manifest; keep the newest ``keep_last``."""
    path = checkpoint_path(run_dir, step)
    make_directory(path.parent)
    _manifest_of(path).unlink(missing_ok=True)  # a same-step save of a resumed run: never a stale one
    write_atomic(path, lambda handle: torch.save({"format": FORMAT, **state}, handle))
    # Read back from the page cache: the checksum is of what the file system holds.
    manifest.write(_manifest_of(path), manifest.describe_files(path.parent, [path.name]))
    prune(run_dir, keep_last)
    return path


def partial_dir(run_dir: Path, step: int) -> Path:
    """Where every rank writes the shards of ``step`` before the directory is renamed into place."""
    return sharded_checkpoint_path(run_dir, step).with_name(f"step-{step:08d}.partial")


def begin_sharded(run_dir: Path, step: int) -> Path:
    """Rank 0, before the writers start: an empty partial directory for ``step``."""
    partial = partial_dir(run_dir, step)
    shutil.rmtree(partial, ignore_errors=True)  # left by a run that died while saving
    final = sharded_checkpoint_path(run_dir, step)
    for path in (partial, final):  # before any rank writes a shard
        if path.exists() and not path.is_dir():
            raise in_the_way(path, "a file", "a checkpoint directory")
    make_directory(partial)
    return partial


def add_trainer_state(run_dir: Path, step: int, trainer_state: dict[str, Any]) -> None:
    """Rank 0: write ``trainer.pt`` into the partial directory of ``step``."""
    write_atomic(partial_dir(run_dir, step) / TRAINER_FILE,
                 lambda handle: torch.save({"format": FORMAT, **trainer_state}, handle))


def sharded_files(run_dir: Path, step: int) -> list[str]:
    """Every file in the partial directory of ``step`` but its manifest, relative to it, sorted."""
    partial = partial_dir(run_dir, step)
    names = (str(f.relative_to(partial)) for f in partial.rglob("*") if f.is_file())
    return sorted(name for name in names if name != manifest.DIRECTORY_MANIFEST)


def write_sharded_manifest(run_dir: Path, step: int, names: list[str], collective: bool, group: Any = None) -> None:
    """Hash the files of the partial directory of ``step`` and write its manifest into it.

    With ``collective``, every rank of ``group`` (default: the default group) calls it
    with the same ``names`` and hashes its share; only rank 0 writes.
    """
    partial = partial_dir(run_dir, step)
    files = manifest.describe_files(partial, names, collective, group)
    ranks = manifest.process_group(group) if collective else None
    if ranks is None or ranks[0] == 0:
        # Written before the rename: a directory under its final name always has its manifest.
        manifest.write(partial / manifest.DIRECTORY_MANIFEST, files)


def publish_sharded(run_dir: Path, step: int, keep_last: int) -> Path:
    """Rank 0: rename the partial directory of ``step`` into place and prune old checkpoints."""
    partial = partial_dir(run_dir, step)
    final = sharded_checkpoint_path(run_dir, step)
    if final.exists():  # the same step saved again (a resumed run): replace it
        stale = final.with_name(final.name + ".stale")
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        partial.rename(final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        partial.rename(final)
    prune(run_dir, keep_last)
    return final


def write_sharded(run_dir: Path, step: int, is_main: bool, barrier: Callable[[], None],
                  write_shards: Callable[[Path], None], trainer_state: Callable[[], dict[str, Any]],
                  keep_last: int) -> Path:
    """Every rank: write a sharded checkpoint of ``step``; returns its final path.

    ``write_shards(directory)`` is the strategy's collective save; ``trainer_state()``
    is called on rank 0 only, after the shards are complete. The ranks then hash
    the directory's files, each its share, and rank 0 writes the manifest.
    """
    if is_main:
        begin_sharded(run_dir, step)
    barrier()
    write_shards(partial_dir(run_dir, step))
    return finish_sharded(run_dir, step, is_main, barrier, trainer_state, keep_last)


def finish_sharded(run_dir: Path, step: int, is_main: bool, barrier: Callable[[], None],
                   trainer_state: Callable[[], dict[str, Any]], keep_last: int, group: Any = None) -> Path:
    """Every rank of ``group`` (default: the default group), once its shards are written: the trainer
    state, the manifest and the rename of :func:`write_sharded`; returns the final path."""
    barrier()  # every shard is on disk before the directory becomes visible
    final = sharded_checkpoint_path(run_dir, step)
    names: list[Any] = [None]
    if is_main:
        add_trainer_state(run_dir, step, trainer_state())
        names = [sharded_files(run_dir, step)]
    collective = manifest.process_group(group) is not None
    if collective:
        import torch.distributed as dist

        # rank 0's listing: one list, whatever each node's cache shows
        dist.broadcast_object_list(names, src=0, group=group)
    write_sharded_manifest(run_dir, step, names[0], collective, group)
    if is_main:
        publish_sharded(run_dir, step, keep_last)
    barrier()  # nobody reads or prunes checkpoints while rank 0 renames
    return final


def prune(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints, and what killed saves left behind."""
    for _, old in list_checkpoints(run_dir)[:-keep_last]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)  # its manifest is inside
        else:
            _manifest_of(old).unlink(missing_ok=True)
            old.unlink(missing_ok=True)
    kept = {_manifest_of(path) for _, path in list_checkpoints(run_dir)}
    directory = checkpoint_dir(run_dir)
    # Only rank 0 saves, one step at a time, and this runs after its save: nothing here is in flight.
    for leftover in directory.glob("step-*.manifest.json"):
        if leftover not in kept:  # its file was pruned or deleted
            leftover.unlink(missing_ok=True)
    for leftover in [*directory.glob(".step-*.tmp-*"), *directory.glob("step-*.partial")]:
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


# What must be the same for the saved weights and optimiser state to fit the resumed run.
_STATE_KEYS = (("model", "name"), ("model", "stem"), ("model", "patch_size"), ("model", "args"), ("data", "name"),
               ("data", "args"), ("data", "image_size"), ("data", "channels"), ("data", "num_classes"),
               ("optim", "name"))
# Keys added since the first checkpoints: a checkpoint without one was saved with its default.
_DEFAULTS = {("model", "args"): {}, ("data", "args"): {}}


def check_compatible(state: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Raise ``UserError`` if ``state`` was saved by a run whose model or optimiser differ.

    ``current`` is the resumed run's configuration as a plain dict.
    """
    saved = state.get("config", {})
    differences = []
    for section, key in _STATE_KEYS:
        before = saved.get(section, {}).get(key, _DEFAULTS.get((section, key)))
        now = current[section].get(key, _DEFAULTS.get((section, key)))
        if before != now:
            differences.append(f"{section}.{key} was {before!r}, now {now!r}")
    if differences:
        raise UserError(
            f"--resume from {path}",
            "the checkpoint was saved by a run with another model, data or optimiser: " + "; ".join(differences),
            f"resume with the run's own settings (--config {path.parent.parent / 'config.yaml'}), "
            "or start a new run with another --out",
        )


def verify(path: Path, collective: bool = False) -> manifest.Problem | None:
    """What is wrong with checkpoint ``path`` according to its manifest, or None when it is whole.

    With ``collective``, every rank of the default process group calls it for
    the same checkpoint and hashes its share of the files.
    """
    return manifest.problem(_manifest_of(path), collective, prefix=f"{path.name}/" if is_sharded(path) else "")


def loadable(path: Path, problem: manifest.Problem | None) -> bool:
    """Whether checkpoint ``path``, with ``problem`` from :func:`verify`, may be loaded.

    A whole one may; so may a full file whose manifest alone is missing (its save was killed
    between the file and the manifest), unchecked. A directory without its manifest may not:
    nothing says every shard is there.
    """
    return problem is None or (problem.manifest_missing and not is_sharded(path))


def _check_same_candidates(run_dir: Path, candidates: list[tuple[int, Path]]) -> None:
    """Every rank must see the same checkpoints to check them together (and to resume from the same one)."""
    seen = manifest.all_gather([path.name for _, path in candidates])
    if any(names != seen[0] for names in seen):
        differing = [rank for rank, names in enumerate(seen) if names != seen[0]]
        raise UserError(f"checkpoints in {checkpoint_dir(run_dir)}",
                        f"ranks {', '.join(map(str, differing))} see other checkpoints there than rank 0",
                        "put --out on a file system every node sees (not a node's local disk)")


def load_newest(run_dir: Path, collective: bool = False) -> tuple[dict[str, Any], Path] | None:
    """The newest whole checkpoint that loads, or ``None`` when the run has none.

    For a sharded checkpoint the state is its trainer state only: the strategy
    reads the model and optimiser from the directory. Each candidate's manifest
    is checked first (sizes, then SHA-256). One that is truncated, corrupt,
    incomplete or does not load is reported with a warning naming the file and
    skipped in favour of the one before it; if none is left, that is an error.
    A full file without a manifest (its save was killed between the file and
    the manifest, or it was copied alone) is whole, being renamed into place
    when complete: it is loaded, with a warning that it could not be checked.
    A directory without one is skipped: nothing says every shard is there
    (its manifest is written inside it before the rename, and copied with it).

    With ``collective`` (every rank of the default process group calls it), the
    ranks share the hashing and agree on the verdicts; only rank 0 warns.
    """
    group = manifest.process_group() if collective else None
    speaks = group is None or group[0] == 0
    candidates = list_checkpoints(run_dir)
    if group is not None:
        _check_same_candidates(run_dir, candidates)
    for _, path in reversed(candidates):
        wrong = verify(path, collective)
        if not loadable(path, wrong):
            if speaks:
                warnings.warn(f"checkpoint {path} {wrong.text}; trying an older one", stacklevel=2)
            continue
        if wrong is not None and speaks:
            warnings.warn(f"checkpoint {path} {wrong.text}: loading it without checking its contents",
                          stacklevel=2)
        try:
            state = torch.load(path / TRAINER_FILE if is_sharded(path) else path, map_location="cpu",
                               weights_only=True)
        except Exception as exc:  # any unreadable file: fall back to an older one
            warnings.warn(f"checkpoint {path} does not load ({type(exc).__name__}); trying an older one",
                          stacklevel=2)
            continue
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            warnings.warn(f"checkpoint {path} is not a {FORMAT} file; trying an older one", stacklevel=2)
            continue
        return state, path
    if candidates:
        raise UserError(f"checkpoints in {checkpoint_dir(run_dir)}",
                        "none of them loads: each is damaged, incomplete or unreadable (see the warnings above)",
                        "start afresh without --resume, or restore a good copy of a checkpoint and its manifest")
    return None
