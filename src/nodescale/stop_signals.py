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
# Set by the rendered job scripts: rank 0 writes this file when it stops for requeue, because
# under torchrun the workers' exit code does not reach the job script (torchrun exits 1).
REQUEUE_FILE_VARIABLE = "NODESCALE_REQUEUE_FILE"

ALLOWED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGXCPU")


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
