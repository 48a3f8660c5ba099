"""``metrics.jsonl`` and the metric loggers behind it, written by global rank 0 only."""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, TextIO

from nodescale.engine.file_errors import file_error
from nodescale.observe.sink import Sink, Status


class MetricsLog:
    """Appends records to ``run_dir/metrics.jsonl`` on rank 0 and hands them to the sinks; a no-op elsewhere.

    The file is created at the first record, so a run that fails before
    training (bad data, say) leaves no metrics behind to block a rerun.
    A sink that fails while the run trains (a tracking server gone, a full
    disk) is dropped with a warning: hours of training are worth more than a chart.
    """

    def __init__(self, path: Path, enabled: bool, sinks: Sequence[Sink] = ()) -> None:
        self.path = path
        self.enabled = enabled
        self.sinks: list[Sink] = list(sinks) if enabled else []
        self.sink_seconds = 0.0  # wall time spent in the sinks' write(): what the loggers cost the run
        self._handle: TextIO | None = None

    def start(self, config: dict[str, Any], resumed: bool) -> None:
        """Open every sink with the resolved configuration; an error here stops the run before it trains."""
        for sink in self.sinks:
            sink.start(config, resumed)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record``; a file that cannot be written (a full disk) is a UserError naming it."""
        if not self.enabled:
            return
        stamped = {"time": round(time.time(), 3), **record}
        try:
            if self._handle is None:
                self._handle = open(self.path, "a", buffering=1)  # line-buffered: whole lines
            self._handle.write(json.dumps(stamped) + "\n")
        except OSError as error:
            self._give_up()
            raise file_error(f"metrics file {self.path}", self.path, error, "check the file system",
                             "the checkpoints so far are whole, and the run resumes from them") from error
        began = time.perf_counter()
        for sink in list(self.sinks):
            try:
                sink.write(stamped)
            except Exception as exc:  # noqa: BLE001 - any logger failure; training goes on
                warnings.warn(f"metric logger {sink.name} failed ({type(exc).__name__}: {exc}); it is switched "
                              "off for the rest of the run", stacklevel=2)
                self.sinks.remove(sink)
                try:  # flush and close what it has, if it still can
                    sink.finish(None, "failed")
                except Exception:  # noqa: BLE001
                    pass
        self.sink_seconds += time.perf_counter() - began

    def _give_up(self) -> None:
        """No more writes: what is still buffered would only fail again on close."""
        self.enabled = False
        if self._handle is not None:
            with suppress(OSError):
                self._handle.close()
            self._handle = None

    def close(self, summary: dict[str, Any] | None = None, status: Status = "finished") -> None:
        """Finish every sink (``summary``: the run's summary.json, None if it has none) and close the file."""
        for sink in self.sinks:
            try:
                sink.finish(summary, status)
            except Exception as exc:  # noqa: BLE001
                warnings.warn(f"metric logger {sink.name} failed to finish ({type(exc).__name__}: {exc})",
                              stacklevel=2)
        self.sinks = []
        if self._handle is not None:
            self._handle.close()
            self._handle = None
