"""Names of the signals that ask a run to stop for requeue, and the exit codes that go with it.

No torch here: the configuration schema validates ``train.stop_signals`` with it, and the
job-script renderers use the exit code, both in processes that never import torch.
"""

from __future__ import annotations

import signal

from nodescale.errors import UserError

# The exit code of every rank after a stop signal was agreed on and the checkpoint written.
# 0 is success, 1 a crash (also torchrun's code for any failed worker), 2 a user error.
EXIT_REQUEUE = 3
# The exit code of a rank whose heartbeat watchdog found another rank stuck.
EXIT_HANG = 4
# Set by the rendered job scripts and the local launcher: rank 0 writes this file, with the step of
# its checkpoint, when every rank stopped for requeue. It is the only evidence a job script or the
# launcher believes: an exit code of 3 proves nothing (any program may exit 3; torchrun exits 1).
REQUEUE_FILE_VARIABLE = "NODESCALE_REQUEUE_FILE"
# The marker's line that names the step (the job scripts read it with sed: keep it one plain line).
REQUEUE_STEP_KEY = "step"

ALLOWED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGXCPU")
# train.stop_signals' default, and nodescale.preemption's: the schedulers' warnings and the launchers' stop.
DEFAULT = "SIGTERM,SIGUSR1,SIGUSR2"


def normalise_signal_names(text: str) -> str:
    """``"usr1, SIGTERM"`` -> ``"SIGUSR1,SIGTERM"``; ``"none"`` or blank -> ``""``; UserError otherwise."""
    names = [part.strip().upper() for part in str(text).split(",") if part.strip()]
    if names in ([], ["NONE"]):
        return ""
    canonical = []
    for name in names:
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full not in ALLOWED:
            raise UserError(f"stop signal {name!r}", f"not one of {', '.join(ALLOWED)}",
                            "e.g. --stop-signals SIGTERM,SIGUSR1, or 'none'")
        canonical.append(full)
    return ",".join(dict.fromkeys(canonical))


def parse_signals(text: str) -> list[signal.Signals]:
    """The signals of a normalised ``train.stop_signals`` value."""
    return [signal.Signals[name] for name in normalise_signal_names(text).split(",") if name]


def requeue_marker(step: int, run_dir: str | None = None) -> str:
    """The requeue marker's text: the checkpoint's step (the job script compares it with the previous stop's)."""
    return f"{REQUEUE_STEP_KEY}={int(step)}\n" + (f"run_dir={run_dir}\n" if run_dir else "")


def marker_step(text: str) -> int | None:
    """The step a requeue marker names, or None when it names none."""
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key == REQUEUE_STEP_KEY and value.strip().isdigit():
            return int(value)
    return None
