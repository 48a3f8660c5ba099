"""An MLflow run per nodescale run: parameters, metric histories, tags and end status.

Everything goes through one ``MlflowClient`` and the run id, never through
``mlflow.start_run``'s process-wide active run, so a program that uses MLflow
itself (or trains twice) keeps its own runs apart from ours.
"""

from __future__ import annotations

import os
import posixpath
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from nodescale.atomic_files import write_json_atomic
from nodescale.errors import UserError
from nodescale.observe.run_file import read_run_file
from nodescale.observe.sink import Status, final_scalars, flat_params, scalars_of

RUN_FILE = "mlflow_run.json"
# summary.json entries that describe how the run ran, recorded as run tags (searchable, e.g. tags.strategy = "fsdp").
TAG_KEYS: tuple[str, ...] = ("world_size", "strategy", "backend", "devices", "device", "precision", "model", "dataset")
END_STATUS: dict[str, str] = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}
BATCH = 100  # MLflow accepts at most 100 params or tags per log_batch call
KEY_LENGTH = 250  # and keys of at most 250 characters


class MlflowSink:
    """Logs to the run named after the run directory in ``experiment``, on the tracking server or store given.

    Tracking URI: ``tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else a file
    store in ``RUN/mlruns``. The run id is kept in ``RUN/mlflow_run.json``; a
    resumed run continues that MLflow run (same store) and appends to its
    metric histories. Params are immutable in MLflow, so a resumed run logs
    only the parameters the run does not have yet (``checkpoint.resume``, say,
    keeps the first part's value). An unreachable server retries as MLflow's
    ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / ``MLFLOW_HTTP_REQUEST_TIMEOUT`` say
    (about 4 minutes by default) before the run stops with a UserError.
    """

    name = "mlflow"

    def __init__(self, run_dir: Path, tracking_uri: str | None, experiment: str) -> None:
        self.run_dir = run_dir
        self.experiment = experiment
        chosen = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self.default_store = chosen is None
        self.tracking_uri = chosen or (run_dir.absolute() / "mlruns").as_uri()
        self.run_id: str | None = None
        self._client: Any = None
        self._last_step = 0

    def start(self, config: dict[str, Any], resumed: bool) -> None:
        if _is_file_store(self.tracking_uri):
            # MLflow 3 refuses file stores unless asked; a user who set it either way keeps their choice.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            with _fail_fast():
                self._client = MlflowClient(tracking_uri=self.tracking_uri)
                run = self._continued_run() if resumed else None
                if run is None:
                    run = self._client.create_run(self._experiment_id(), run_name=self.run_dir.name,
                                                  tags={"nodescale.run_dir": str(self.run_dir.absolute())})
        except (MlflowException, OSError) as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"MLflow tracking URI {self.tracking_uri!r}",
                f"the tracking server or store must be reachable and writable when the run starts ({first_line})",
                "check that the server is up and the URI is right, pass another with --mlflow-uri, "
                "or drop mlflow from --log",
            ) from exc
        self.run_id = run.info.run_id
        write_json_atomic(self.run_dir / RUN_FILE, {
            "run_id": self.run_id, "experiment_id": run.info.experiment_id,
            "tracking_uri": self.tracking_uri, "default_store": self.default_store,
        })
        self._log_params(config, already=set(run.data.params))

    def write(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        scalars = scalars_of(record)
        if self._client is None or not scalars:
            return
        step = int(record.get("step", self._last_step))
        stamp = int(float(record.get("time", time.time())) * 1000)  # MLflow timestamps are milliseconds
        self._client.log_batch(self.run_id, metrics=[Metric(key, value, stamp, step) for key, value in scalars.items()])
        self._last_step = step

    def finish(self, summary: dict[str, Any] | None, status: Status) -> None:
        from mlflow.entities import Metric, RunTag

        if self._client is None:
            return
        summary = summary or {}
        stamp = int(time.time() * 1000)
        metrics = [Metric(key, value, stamp, self._last_step) for key, value in final_scalars(summary).items()]
        tags = [RunTag(key, str(summary[key])) for key in TAG_KEYS if summary.get(key) is not None]
        if metrics or tags:
            self._client.log_batch(self.run_id, metrics=metrics, tags=tags)
        self._client.set_terminated(self.run_id, END_STATUS[status])
        self._client = None

    def _continued_run(self) -> Any:
        """The MLflow run an earlier part of this run logged to, set back to RUNNING (None: none to continue)."""
        from mlflow.exceptions import MlflowException

        saved = read_run_file(self.run_dir / RUN_FILE)
        # Our default store lives in the run directory: still the same store if the directory moved.
        moved_default = self.default_store and saved.get("default_store") is True
        same_store = saved.get("tracking_uri") == self.tracking_uri or moved_default
        if not saved.get("run_id") or not same_store:
            return None
        try:
            run = self._client.get_run(saved["run_id"])
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":  # deleted, or a fresh store: start a new run
                return None
            raise
        if run.info.lifecycle_stage != "active":
            return None
        self._client.update_run(run.info.run_id, status="RUNNING")
        return run

    def _experiment_id(self) -> str:
        experiment = self._client.get_experiment_by_name(self.experiment)
        if experiment is None:
            try:
                return self._client.create_experiment(self.experiment)
            except Exception:  # noqa: BLE001 - another run created it in between: use theirs
                experiment = self._client.get_experiment_by_name(self.experiment)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage != "active":
            raise UserError(f"MLflow experiment {self.experiment!r}", f"is deleted in {self.tracking_uri}",
                            "restore it (`mlflow experiments restore`) or choose another with --experiment")
        return experiment.experiment_id

    def _log_params(self, config: dict[str, Any], already: set[str]) -> None:
        from mlflow.entities import Param

        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as value_length
        except ImportError:  # moved in some future version: the oldest limit MLflow had
            value_length = 500
        params: dict[str, str] = {}
        for key, value in flat_params(config).items():
            params.setdefault(param_key(key), str(value)[:value_length])
        todo = [Param(key, value) for key, value in params.items() if key not in already]
        for first in range(0, len(todo), BATCH):
            self._client.log_batch(self.run_id, params=todo[first:first + BATCH])


def param_key(key: str) -> str:
    """``key`` as a valid MLflow param name: letters, digits, ``_ - . / space`` only, not a path that moves.

    >>> param_key("model.kwargs.a:b")
    'model.kwargs.a_b'
    """
    # Colons are valid on POSIX only; a store shared with Windows clients would reject them.
    cleaned = re.sub(r"[^\w./\- ]", "_", key)[:KEY_LENGTH]
    if posixpath.normpath(cleaned) != cleaned or cleaned.startswith("/") or cleaned in (".", ".."):
        cleaned = "_" + cleaned.replace("/", "_")  # file stores use names as paths: no '..', '//', leading '/'
    return cleaned[:KEY_LENGTH]


def _is_file_store(uri: str) -> bool:
    scheme = urlparse(uri).scheme
    # A bare path is a file store too, except the profile names MLflow reads as Databricks workspaces.
    return scheme == "file" or (scheme == "" and uri not in ("databricks", "databricks-uc", "uc"))


# At start-up a wrong URI should cost seconds, not MLflow's default ~4 minutes of retries with back-off
# while the job holds its nodes; during training the defaults ride out a server's hiccups.
START_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


@contextmanager
def _fail_fast() -> Iterator[None]:
    """Few retries and a short timeout while the run is opened, unless the user set their own."""
    unset = [name for name in START_RETRIES if name not in os.environ]
    os.environ.update({name: START_RETRIES[name] for name in unset})
    try:
        yield
    finally:
        for name in unset:
            os.environ.pop(name, None)
