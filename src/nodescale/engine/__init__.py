"""The engine behind ``nodescale.init``: settings, run files and checkpoints of a library script."""
