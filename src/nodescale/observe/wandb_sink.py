"""A Weights & Biases run per nodescale run, offline by default (``RUN/wandb``, uploaded later with ``wandb sync``)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from nodescale.atomic_files import write_json_atomic
from nodescale.errors import UserError
from nodescale.observe.run_file import read_run_file
from nodescale.observe.sink import Status, final_scalars, scalars_of

RUN_FILE = "wandb_run.json"
LOGIN_HINT = ("run `wandb login` (or set WANDB_API_KEY) on this machine first, or log offline with "
              "--wandb-mode offline and upload later with `wandb sync RUN/wandb/offline-run-*`")


class WandbSink:
    """Logs the scalars of every step and epoch record to the W&B step ``record["step"]``.

    Mode: ``mode`` ("offline" or "online"), unless the environment sets
    ``WANDB_MODE``, which wins (the usual W&B convention, so a cluster can
    force offline or disabled). Online mode needs credentials already in place
    (WANDB_API_KEY, ``wandb login``): without them start() raises UserError
    rather than prompting, since batch jobs have no terminal to answer.

    Steps: W&B keeps one history row per step and steps may only increase.
    Records are logged with ``step=`` and W&B's default ``commit=False`` for an
    explicit step, so an epoch record at the same step as the last step record
    joins that row, and the row is written when a later step (or finish) comes.
    A record at a lower step (a resumed online run replaying the steps past its
    checkpoint, which W&B already has) is skipped here instead of being dropped
    by W&B with a warning per call.

    The run id (and, at finish, the last step logged) is kept in
    ``RUN/wandb_run.json``: a resumed run continues the same W&B run. Online,
    W&B reopens it in the project. Offline, W&B cannot reopen a run: the new
    part gets its own ``offline-run-*`` directory with the same id, and starts
    after the last step of the part before, so the parts can be uploaded in
    order into one run (the later ones with ``wandb sync --append``).
    """

    name = "wandb"

    def __init__(self, run_dir: Path, project: str, mode: str) -> None:
        self.run_dir = run_dir
        self.project = project
        self.mode = mode
        self.run_id: str | None = None
        self._run: Any = None
        self._step: int | None = None  # the step of the row being filled (None: nothing logged yet)
        self._floor = 0

    def start(self, config: dict[str, Any], resumed: bool) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or self.mode
        saved = read_run_file(self.run_dir / RUN_FILE) if resumed else {}
        self.run_id = str(saved.get("id") or secrets.token_hex(6))  # W&B ids: lowercase letters and digits
        try:
            if mode in ("online", "run") and not _has_credentials(wandb):  # "run": an old name for online
                raise UserError("W&B online mode", "needs an API key, and none is configured (WANDB_API_KEY, "
                                "~/.netrc from `wandb login`)", LOGIN_HINT)
            self._save(saved.get("last_step"))
            self._run = wandb.init(project=self.project, dir=str(self.run_dir), mode=mode, name=self.run_dir.name,
                                   config=config, id=self.run_id, resume="allow", settings=_quiet_settings(wandb))
        except wandb.errors.Error as exc:
            hint = LOGIN_HINT if mode in ("online", "run") else (
                f"see {self.run_dir / 'wandb' / 'debug-internal.log'}, or drop wandb from --log")
            raise UserError(f"W&B run in project {self.project!r} ({mode})", f"could not start: {exc}", hint) from exc
        # A resumed run goes on after the last step logged: online W&B knows it, offline our file does.
        self._floor = max(int(getattr(self._run, "starting_step", 0) or 0), int(saved.get("last_step", -1)) + 1)

    def write(self, record: dict[str, Any]) -> None:
        scalars = scalars_of(record)
        if self._run is None or not scalars:
            return
        step = int(record.get("step", self._step or 0))
        if step < self._floor or (self._step is not None and step < self._step):
            return
        self._run.log(scalars, step=step)
        self._step = step

    def finish(self, summary: dict[str, Any] | None, status: Status) -> None:
        if self._run is None:
            return
        if summary:
            self._run.summary.update(final_scalars(summary))
        if self._step is not None:
            self._save(self._step)
        # W&B knows finished (0) and failed (non-zero); a stopped run did not finish, and resumes later.
        self._run.finish(exit_code=0 if status == "finished" else 1)
        self._run = None

    def _save(self, last_step: int | None) -> None:
        state: dict[str, Any] = {"id": self.run_id, "project": self.project}
        if last_step is not None:
            state["last_step"] = int(last_step)
        write_json_atomic(self.run_dir / RUN_FILE, state)


def _has_credentials(wandb: Any) -> bool:
    """Whether W&B finds an API key where it looks for one, without ever prompting."""
    try:
        return bool(wandb.login(prompt=False, verify=False))
    except TypeError:  # a wandb without login(prompt=...): look in the usual two places ourselves
        import netrc
        from urllib.parse import urlparse

        if os.environ.get("WANDB_API_KEY"):
            return True
        host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
        try:
            return netrc.netrc().authenticators(host) is not None
        except (OSError, netrc.NetrcParseError):
            return False


def _quiet_settings(wandb: Any) -> Any:
    """Settings that keep W&B silent and cheap: no console capture, no system-metrics sampling, no pip listing."""
    wanted: dict[str, Any] = {
        "silent": True,
        "console": "off",  # the trainer's own output stays as it is; RUN has the logs
        "x_disable_stats": True,  # a sampler process polling CPU/GPU every few seconds, for charts we already log
        "x_save_requirements": False,
        "save_code": False,
        "reinit": "create_new",  # never hand back (or finish) a run the user's own code started
    }
    fields = getattr(wandb.Settings, "model_fields", None)
    if fields is None:  # wandb before 0.19: other field names; these two it always had
        return wandb.Settings(silent=True, console="off")
    if "reinit" in fields and "create_new" not in str(fields["reinit"].annotation):
        del wanted["reinit"]
    return wandb.Settings(**{key: value for key, value in wanted.items() if key in fields})
