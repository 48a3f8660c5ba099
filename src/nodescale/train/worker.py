"""Entry point of one worker process started by nodescale's local launcher.

``python -m nodescale.train.worker CONFIG.yaml``: the launcher has already
validated the configuration, chosen the run directory and written this copy
of the configuration into a temporary directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from nodescale.dist.local_launch import ERROR_DIR_VARIABLE
from nodescale.errors import EXIT_USER_ERROR, UserError


def main(argv: list[str]) -> int:
    from nodescale.config.load import load_config
    from nodescale.train.run import run_training

    try:
        run_training(load_config(argv[0]))
    except UserError as exc:
        rank = os.environ.get("RANK", "0")
        error_dir = os.environ.get(ERROR_DIR_VARIABLE)
        if error_dir:  # the local launcher prints each distinct error once
            Path(error_dir, f"rank-{rank}.txt").write_text(str(exc))
        else:
            print(f"nodescale: error (rank {rank}): {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
