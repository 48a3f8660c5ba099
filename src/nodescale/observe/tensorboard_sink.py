"""TensorBoard event files in ``RUN/tensorboard``: the scalars, the configuration as text and as hparams."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from nodescale.observe.sink import SCALAR_NAMES, Status, final_scalars, flat_params, scalars_of

# The tags the HPARAMS tab shows next to each run's hyper-parameters (their last values).
HPARAM_METRICS: tuple[str, ...] = ("val/loss", "val/accuracy", "train/loss", "final/samples_per_second")
# How a session of the hparams plugin ended; a stopped run has none yet: it resumes later, in the same session.
SESSION_END: dict[str, str] = {"finished": "STATUS_SUCCESS", "failed": "STATUS_FAILURE"}


class TensorBoardSink:
    """Writes every step and epoch scalar at ``global_step=step`` with the record's wall time.

    A resumed run appends a new event file to the same directory. Its first
    step is marked with a ``SessionLog.START`` event (what ``SummaryWriter``'s
    ``purge_step`` writes), so TensorBoard drops the points the first part
    logged past the checkpoint the run resumed from instead of drawing them twice.
    """

    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._writer: Any = None
        self._last_step = 0
        self._mark_restart = False

    def start(self, config: dict[str, Any], resumed: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Flushed every 30 s (not 120) so a live TensorBoard follows the run closely; writing is asynchronous.
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=30)
        self._mark_restart = resumed
        # Indented: the text plugin renders Markdown, and an indented block keeps YAML's layout.
        text = yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
        self._writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), global_step=0)
        # Written into this writer's own file rather than with add_hparams, which would open a
        # timestamped sub-directory that TensorBoard lists as a second run.
        experiment, session_start, _ = hparams(_hparam_values(config), dict.fromkeys(HPARAM_METRICS, 0.0))
        self._writer.file_writer.add_summary(experiment)
        self._writer.file_writer.add_summary(session_start)

    def write(self, record: dict[str, Any]) -> None:
        if self._writer is None or record.get("kind") not in SCALAR_NAMES:
            return
        step = int(record.get("step", self._last_step))
        if self._mark_restart:
            self._restart_at(step)
        walltime = record.get("time")
        for tag, value in scalars_of(record).items():
            self._writer.add_scalar(tag, value, global_step=step, walltime=walltime)
        self._last_step = step

    def finish(self, summary: dict[str, Any] | None, status: Status) -> None:
        if self._writer is None:
            return
        now = time.time()
        for tag, value in final_scalars(summary or {}).items():
            self._writer.add_scalar(tag, value, global_step=self._last_step, walltime=now)
        if status in SESSION_END:
            self._writer.file_writer.add_summary(_session_end(SESSION_END[status]))
        self._writer.flush()
        self._writer.close()
        self._writer = None

    def _restart_at(self, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self._writer.file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
        self._mark_restart = False


def _hparam_values(config: dict[str, Any]) -> dict[str, str | float]:
    # torch's hparams() tests int before bool, so a bool would show as 1.0/0.0: pass it as text.
    return {key: str(value).lower() if isinstance(value, bool) else value
            for key, value in flat_params(config).items()}


def _session_end(code: str) -> Any:
    """The hparams plugin's end-of-session summary with status ``code`` (torch's helper always says success)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    info = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value(code), end_time_secs=time.time())
    content = plugin_data_pb2.HParamsPluginData(session_end_info=info, version=metadata.PLUGIN_DATA_VERSION)
    plugin = SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME, content=content.SerializeToString())
    value = Summary.Value(tag=metadata.SESSION_END_INFO_TAG, metadata=SummaryMetadata(plugin_data=plugin))
    return Summary(value=[value])
