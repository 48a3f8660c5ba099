"""Entry point of one worker process started by nodescale's local launcher.

``python -m nodescale.train.worker RUN_DIR/config.yaml``: the launcher has
already validated the configuration and chosen the run directory.
"""

from __future__ import annotations

import os
import sys

from nodescale.errors import EXIT_USER_ERROR, UserError


def main(argv: list[str]) -> int:
    from nodescale.config.load import load_config
    from nodescale.train.run import run_training

    try:
        run_training(load_config(argv[0]))
    except UserError as exc:
        rank = os.environ.get("RANK", "0")
        print(f"nodescale: error (rank {rank}): {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
