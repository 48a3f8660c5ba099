"""What training prints: a progress bar on a terminal, a line per epoch, rank 0 only.

In a batch job (no terminal) a bar would be a stream of control characters in
the log, so there it prints one line per epoch and per log interval only.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from rich.console import Console as RichConsole
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class Console:
    """Rank 0's view of a run; every method is silent on other ranks."""

    def __init__(self, enabled: bool, progress: bool) -> None:
        self.enabled = enabled
        # Under the local launcher with several ranks stdout is a pipe, passed on to the terminal as it is.
        columns = os.environ.get("NODESCALE_TERMINAL_COLUMNS", "")  # local_rank_output.TERMINAL_VARIABLE
        on_terminal = sys.stdout.isatty() or columns.isdigit()
        self.rich = RichConsole(highlight=False, force_terminal=on_terminal or None,
                                width=int(columns) if columns.isdigit() and not sys.stdout.isatty() else None)
        self.bar = progress and enabled and on_terminal
        self._progress: Progress | None = None
        self._task: Any = None
        self._status = ""

    def print(self, *objects: Any) -> None:
        if self.enabled:
            self.rich.print(*objects, soft_wrap=True)  # whole lines in batch-job logs

    def note(self, text: str) -> None:
        self.print(f"[yellow]note:[/] {text}")

    def start(self, total_steps: int, done: int) -> None:
        if not self.bar:
            return
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(), console=self.rich, transient=True,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=done, status="")
        self._progress.start()

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=self._status)

    def interval(self, record: dict[str, Any]) -> None:
        self._status = f"loss {record['loss']:.4f}"
        if not self.bar and self.enabled and record.get("samples_per_second"):
            self.print(
                f"  step {record['step']:>6}  loss {record['loss']:.4f}"
                + (f"  acc {record['accuracy']:.2%}" if record.get("accuracy") is not None else "")
                + f"  {record['samples_per_second']:,.0f} samples/s"
                + (f"  {record['tokens_per_second']:,.0f} tokens/s" if record.get("tokens_per_second") else "")
                + (f"  MFU {record['mfu']:.1%}" if record.get("mfu") is not None else "")
            )

    def epoch(self, record: dict[str, Any], epochs: int) -> None:
        accuracy = record.get("val_accuracy")
        self.print(
            f"epoch {record['epoch'] + 1}/{epochs}  val_loss {record['val_loss']:.4f}"
            + (f"  val_acc {accuracy:.2%}" if accuracy is not None else "")
            + (f"  val_ppl {record['val_perplexity']:.3f}" if record.get("val_perplexity") is not None else "")
            + f"  {record['epoch_seconds']:.2f} s"
        )

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
