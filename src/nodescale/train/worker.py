"""Entry point of one worker process started by nodescale's local launcher.

``python -m nodescale.train.worker CONFIG.yaml``: the launcher has already
validated the configuration, chosen the run directory and written this copy
of the configuration into a temporary directory.
"""

from __future__ import annotations

import sys
import warnings

from nodescale.errors import EXIT_USER_ERROR, UserError, one_line_warning
from nodescale.launch.schedulers.local_launcher import report_user_error


def main(argv: list[str]) -> int:
    from nodescale.config.load import load_config
    from nodescale.train.run import run_training_as_worker

    warnings.formatwarning = one_line_warning  # type: ignore[assignment]
    try:
        run_training_as_worker(load_config(argv[0]))
    except UserError as exc:
        report_user_error(exc)  # to the local launcher, which prints each distinct error once
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
